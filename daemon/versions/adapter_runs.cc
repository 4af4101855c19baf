// AdapterRuns (adapter_runs.h), LoRA adapters: waiting for a newly
// attached adapter's first fill, and the unload run.
#include "daemon/versions/adapter_runs.h"

#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ferry {

AdapterRuns::AdapterRuns(absl::Mutex& mu, absl::CondVar& changed,
                         RunDriver* driver, PlanCache* plans,
                         absl::Duration version_timeout)
    : mu_(mu),
      changed_(changed),
      driver_(driver),
      plans_(plans),
      version_timeout_(version_timeout) {}

v1::InstanceStatus AdapterRuns::WaitForFill(
    const std::string& stream, const std::string& instance_id,
    absl::Duration timeout, const Expired& expired) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  while (true) {
    const StreamState* st = driver_->FindStream(stream);
    const int64_t latest = st == nullptr ? 0 : st->latest_committed;
    const v1::InstanceStatus* rec = driver_->FindRecord(instance_id);
    v1::InstanceStatus s;
    if (rec != nullptr) {
      s = *rec;
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
    const bool pending =
        driver_->BootstrapPending(stream) ||
        (st != nullptr &&
         (st->current != nullptr || st->delivery != nullptr));
    if (!pending || absl::Now() >= deadline || (expired && expired()) ||
        driver_->ShuttingDown()) {
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

absl::Status AdapterRuns::UnloadAdapter(const std::string& stream,
                                               const std::string& instance_id,
                                               const Expired& expired) {
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  const int32_t target = (*plan)->FindInstance(instance_id);
  if (target < 0) {
    return absl::NotFoundError(absl::StrCat(
        "stream ", stream, " has no complete instance ", instance_id));
  }
  const absl::Time deadline = absl::Now() + version_timeout_;
  absl::MutexLock lock(&mu_);
  // Adapter versions come every training step and take milliseconds: wait
  // for the slot rather than refuse.
  std::string blocked;
  while (!(blocked = driver_->Busy(stream, /*instance_id=*/"")).empty()) {
    if (driver_->ShuttingDown()) return absl::UnavailableError(blocked);
    if (absl::Now() >= deadline || (expired && expired())) {
      return absl::DeadlineExceededError(
          absl::StrCat("the stream stayed busy: ", blocked));
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
  }
  const v1::InstanceStatus* rec = driver_->FindRecord(instance_id);
  const int64_t held = rec == nullptr ? 0 : rec->committed_version();
  std::shared_ptr<VersionRun> run = driver_->StartSlotRun(
      *plan, target, RunKind::kUnloadAdapter, held, /*donor=*/"");
  InstanceRun& inst = run->instances[0];
  inst.phase = RunPhase::kUnload;
  driver_->Send(*run, inst, v1::UPDATE_EVENT_KIND_UNLOAD_ADAPTER, nullptr);
  driver_->Record(*run, inst);
  changed_.SignalAll();
  driver_->WaitWhile(*run, RunPhase::kUnload);
  driver_->Advance(run);
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
