// ModelSwaps: Lifecycle.SwapModel's gathering of an instance's ranks. Each
// TP rank calls with its current handle and its new registration (parsed
// and mapped by the caller); the instance switches when all tp_size ranks
// have called, in one Registry step (Registry::ReplaceInstance), so either
// every rank follows the new registration or every rank stays on the old.
// Until then the instance follows the old registration and takes part in
// versions as before.
//
// A swap fails for every rank that called (ABORTED naming why) when one
// rank's new registration is invalid (that rank's own call gets the
// INVALID_ARGUMENT), when a rank does not call within the wait, when a
// caller gives up, or when a version or a peer delivery is in progress on
// the instance at the switch (FAILED_PRECONDITION naming it).
//
// Owner: the LifecycleService. Threading: thread-safe; Swap blocks its
// gRPC thread until the swap ends.
#ifndef FERRY_DAEMON_LIFECYCLE_MODEL_SWAPS_H_
#define FERRY_DAEMON_LIFECYCLE_MODEL_SWAPS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/registry/registry.h"
#include "daemon/versions/version_coordinator.h"

namespace ferry {

class ModelSwaps {
 public:
  // Not owned. `wait`: how long the first rank waits for the others.
  ModelSwaps(Registry* registry, VersionCoordinator* coordinator,
             absl::Duration wait)
      : registry_(registry), coordinator_(coordinator), wait_(wait) {}

  // One rank's call. `old` is the caller's authenticated destination;
  // `fresh` its new registration (instance id, tp rank and tp size already
  // checked against `old`). Returns the rank's new participant once the
  // instance switched.
  absl::StatusOr<std::shared_ptr<const Participant>> Swap(
      const std::shared_ptr<const Participant>& old,
      std::unique_ptr<Participant> fresh, const std::function<bool()>& expired)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A rank's new registration did not parse: the instance's pending swap
  // (if any) fails for every rank waiting in it.
  void Fail(const std::string& instance_id, int32_t tp_rank,
            const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pending {
    int32_t tp_size = 0;
    std::map<int32_t, std::unique_ptr<Participant>> ranks;  // by tp rank
    bool done = false;
    absl::Status status;  // when done
    std::map<int32_t, std::shared_ptr<const Participant>> result;
  };

  // Ends `p` (already out of pending_) with `status` for every waiter.
  void FinishLocked(Pending& p, absl::Status status)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Registry* const registry_;
  VersionCoordinator* const coordinator_;
  const absl::Duration wait_;
  absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<std::string, std::shared_ptr<Pending>> pending_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_LIFECYCLE_MODEL_SWAPS_H_
