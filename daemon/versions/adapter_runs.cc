// VersionCoordinator, LoRA adapters (version_coordinator.h, adapters.h):
// waiting for a newly attached adapter's first fill, and the unload run.
// Everything else an adapter goes through (versions of its stream, its
// bootstrap from a donor) is the ordinary protocol on its own instance.
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/versions/version_coordinator.h"
#include "glog/logging.h"

namespace ferry {

v1::InstanceStatus VersionCoordinator::WaitForFill(
    const std::string& stream, const std::string& instance_id,
    absl::Duration timeout, const Expired& expired) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    auto st = streams_.find(stream);
    const int64_t latest = st == streams_.end() ? 0
                                                : st->second.latest_committed;
    auto rec = records_.find(instance_id);
    v1::InstanceStatus s;
    if (rec != records_.end()) {
      s = rec->second;
    } else {
      s.set_instance_id(instance_id);
      s.set_state(v1::INSTANCE_STATE_IDLE);
    }
    if (latest == 0) {
      s.set_waiting_reason(absl::StrCat(
          "stream ", stream, " has no committed version yet; the adapter "
          "arrives with its first version"));
      return s;
    }
    if (s.state() == v1::INSTANCE_STATE_COMMITTED &&
        s.committed_version() >= latest) {
      return s;
    }
    // Still on its way: the delivery thread has not looked at the stream
    // yet, or waits for the run in progress to settle, or its bootstrap
    // runs.
    deliveries_.AssertHeld();  // mu_ is its lock
    const bool pending =
        deliveries_.PendingLocked(stream) ||
        (st != streams_.end() &&
         (st->second.current != nullptr || st->second.delivery != nullptr));
    if (!pending || absl::Now() >= deadline || (expired && expired()) ||
        shutting_down_) {
      if (s.waiting_reason().empty() &&
          s.state() != v1::INSTANCE_STATE_ABORTED) {
        s.set_waiting_reason(absl::StrCat(
            "behind the stream's latest committed version ", latest,
            pending ? "; its fill from a peer is still under way"
                    : "; it is filled by the stream's next version"));
      }
      return s;
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
  }
}

absl::Status VersionCoordinator::UnloadAdapter(const std::string& stream,
                                               const std::string& instance_id,
                                               const Expired& expired) {
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  const int32_t target = (*plan)->FindInstance(instance_id);
  if (target < 0) {
    return absl::NotFoundError(absl::StrCat(
        "stream ", stream, " has no complete instance ", instance_id));
  }
  const absl::Time deadline = absl::Now() + options_.version_timeout;
  absl::MutexLock lock(&mu_);
  // Adapter versions come every training step and take milliseconds: wait
  // for the slot rather than refuse.
  std::string blocked;
  while (!(blocked = BusyLocked(stream, /*instance_id=*/"")).empty()) {
    if (shutting_down_) return absl::UnavailableError(blocked);
    if (absl::Now() >= deadline || (expired && expired())) {
      return absl::DeadlineExceededError(
          absl::StrCat("the stream stayed busy: ", blocked));
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
  }
  auto rec = records_.find(instance_id);
  const int64_t held =
      rec == records_.end() ? 0 : rec->second.committed_version();
  std::shared_ptr<VersionRun> run =
      StartSlotRun(*plan, target, RunKind::kUnloadAdapter, held, "");
  InstanceRun& inst = run->instances[0];
  inst.phase = RunPhase::kUnload;
  SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_UNLOAD_ADAPTER);
  SyncRecordLocked(*run, inst);
  changed_.SignalAll();
  WaitWhile(*run, RunPhase::kUnload);
  AdvanceLocked(run);
  LOG(INFO) << "stream " << stream << ": " << instance_id
            << (inst.phase == RunPhase::kCommitted ? " unloaded"
                                                : " unload aborted: ")
            << inst.abort_reason;
  if (inst.phase != RunPhase::kCommitted) {
    return absl::AbortedError(inst.abort_reason);
  }
  return absl::OkStatus();
}

}  // namespace ferry
