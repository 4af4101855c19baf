// What the Registry hands out about its members (registry.h: Snapshot,
// ModelOf): one stream's membership as of one epoch, an instance's ranks,
// a stream's model in sum. Plain values built under the Registry's lock
// and owned by the caller; the participants in them are shared and
// immutable (participant.h), so any thread may read a view.
#ifndef FERRY_DAEMON_REGISTRY_REGISTRY_VIEWS_H_
#define FERRY_DAEMON_REGISTRY_REGISTRY_VIEWS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/model_spec.h"
#include "daemon/registry/load_options.h"
#include "daemon/registry/participant.h"

namespace ferry {

// One instance's registered ranks.
struct InstanceMembers {
  std::string id;
  int32_t tp_size = 0;
  LoadOptions options;       // Lifecycle.UpdateConfig's, or defaults
  int64_t held_version = 0;  // the lowest of its ranks'
  std::vector<std::shared_ptr<const Participant>> ranks;  // by tp rank;
                                                          // null: missing
  bool complete() const;
};

// A consistent view of one stream's membership.
struct StreamSnapshot {
  std::string name;
  uint64_t epoch = 0;  // bumps on every change to the stream's membership
  int32_t world_size = 0;  // 0 while no source is registered
  std::vector<std::shared_ptr<const Participant>> sources;  // by rank;
                                                            // null: missing
  std::vector<InstanceMembers> instances;  // sorted by id
  // While the sources are not complete: the parameters the last complete
  // set of them declared (empty if there never was one).
  // Shared, not copied: a snapshot is taken per plan lookup, and the
  // model of a large checkpoint holds 100,000+ parameters.
  std::shared_ptr<const std::vector<ParamSpec>> retained_model;
  // While they are complete: the parameters they declare (one list, in
  // no particular order), so that a plan need not merge every rank's.
  std::shared_ptr<const std::vector<ParamSpec>> declared_model;
  bool sources_complete() const;
};

// A stream's model as its registered sources declare it: parameters
// (distinct names) and their bytes in all.
struct StreamModelSummary {
  int64_t parameters = 0;
  int64_t bytes = 0;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_REGISTRY_VIEWS_H_
