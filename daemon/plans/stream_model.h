// The first step of a stream's plan (plan_cache.h): the stream's model and
// its sources' pieces in the model's indices, from a Registry snapshot.
//
// Owner: none (free functions). Threading: any thread; SourceLayouts runs
// on the planning threads (core/parallel_for.h) and returns when they are
// done.
#ifndef FERRY_DAEMON_PLANS_STREAM_MODEL_H_
#define FERRY_DAEMON_PLANS_STREAM_MODEL_H_

#include <string>
#include <vector>

#include "core/model_spec.h"
#include "core/piece.h"
#include "daemon/registry/registry.h"

namespace ferry {

// The stream's model: every declared parameter once, sorted by name.
// The sources' parameters; while they are not all registered (a trainer
// gone between runs, or restarting), those of the last complete set.
ModelSpec StreamModel(const Registry::StreamSnapshot& s);

// While the sources are incomplete: the stream's source_error, naming the
// source ranks that are not registered.
std::string MissingSourcesError(const Registry::StreamSnapshot& s);

// Once the sources are complete: each source rank's pieces (by rank) in
// the model's indices.
std::vector<RankLayout> SourceLayouts(const Registry::StreamSnapshot& s,
                                      const ModelSpec& model);

}  // namespace ferry

#endif  // FERRY_DAEMON_PLANS_STREAM_MODEL_H_
