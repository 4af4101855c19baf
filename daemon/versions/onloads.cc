// OffloadRuns (offload_runs.h), onload (Lifecycle.Onload): ONLOAD to every
// rank, then the refill, from the instance's host copy or from a donor
// instance; and which ranks may register new regions meanwhile
// (RegionsFixed).
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/plans/donor_plan.h"
#include "daemon/versions/offload_runs.h"
#include "glog/logging.h"

namespace ferry {

absl::StatusOr<v1::InstanceStatus> OffloadRuns::Onload(
    const std::string& stream, const std::string& instance_id,
    const Expired& expired) {
  const std::string what = absl::StrCat("Onload(", instance_id, ")");
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  const int32_t target = (*plan)->FindInstance(instance_id);
  absl::MutexLock lock(&mu_);
  auto off = offloaded_.find(instance_id);
  if (off == offloaded_.end()) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the instance is not offloaded"));
  }
  if (target < 0) {
    return absl::NotFoundError(absl::StrCat(
        what, ": not every tp rank of instance ", instance_id,
        " is registered on stream ", stream));
  }
  const std::string blocked = driver_->Busy(stream, /*instance_id=*/"");
  if (!blocked.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", blocked));
  }
  const int64_t held = driver_->RecordOf(instance_id).committed_version();
  std::shared_ptr<VersionRun> run = driver_->StartSlotRun(
      *plan, target, RunKind::kOnload, held, /*donor=*/"");
  run->copy = off->second.copy;
  // From here the instance is being onloaded: whatever happens it ends
  // COMMITTED or ABORTED (dirty), never offloaded again.
  offloaded_.erase(off);
  InstanceRun& inst = run->instances[0];
  LOG(INFO) << "stream " << stream << ": onload of instance " << instance_id;
  inst.phase = RunPhase::kOnload;
  driver_->Send(*run, inst, v1::UPDATE_EVENT_KIND_ONLOAD,
                [](const Participant& p, v1::UpdateEvent* e) {
                  for (uint32_t id : p.memory->ids()) {
                    e->mutable_onload()->add_region_ids(id);
                  }
                });
  driver_->Record(*run, inst);
  changed_.SignalAll();  // the ranks' Subscribe streams send it
  driver_->WaitWhile(*run, RunPhase::kOnload);
  if (inst.phase == RunPhase::kPaused) RefillOnloadLocked(run);
  driver_->Settle(*run);
  // Not cut short by the caller's deadline: the members' copies are
  // dropped below, once the run settled (its deadlines bound it).
  while (!run->settled) changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  const v1::InstanceStatus status = driver_->Status(*run, inst);
  // Whatever was not restored (a restore drops what it wrote back) goes:
  // the host copy lasts until the onload, whatever its outcome.
  TellMembersLocked(run->copy.members, v1::MEMORY_ACTION_DROP, what);
  if (expired && expired()) {
    return absl::DeadlineExceededError(absl::StrCat(
        what, ": the call's deadline passed before the onload settled; "
        "ListStreams shows its outcome"));
  }
  return status;
}

void OffloadRuns::RefillOnloadLocked(
    const std::shared_ptr<VersionRun>& run) {
  InstanceRun& inst = run->instances[0];
  const std::string stream = run->stream, id = inst.id;
  // The ranks registered new memory (UpdateRegions): plan again, outside
  // the lock, with the run held open.
  ++run->transfers_in_flight;
  mu_.Unlock();
  absl::StatusOr<std::shared_ptr<const StreamPlan>> now = plans_->Get(stream);
  mu_.Lock();
  --run->transfers_in_flight;
  if (inst.phase != RunPhase::kPaused) return;  // aborted meanwhile
  const int32_t target = now.ok() ? (*now)->FindInstance(id) : -1;
  if (target < 0) {
    driver_->Abort(*run, inst, AbortCause::kRankLost,
                   now.ok() ? std::string("a tp rank left during the onload")
                            : std::string(now.status().message()));
    return;
  }
  const std::vector<std::shared_ptr<const Participant>> ranks =
      (*now)->instances[target].ranks;
  for (const auto& r : ranks) {
    if (r->memory->released()) {
      driver_->Abort(
          *run, inst, AbortCause::kRankFailed,
          absl::StrCat("tp rank ", r->tp_rank, " acked ONLOAD without "
                       "registering its regions again "
                       "(Registry.UpdateRegions)"));
      return;
    }
  }
  const int64_t latest = driver_->StreamOf(stream).latest_committed;
  const KeptCopy copy = run->copy;

  if (copy.kept && copy.version >= latest) {
    RestoreHostCopyLocked(run, *now, target);
    return;
  }
  RefillFromPeerLocked(run, *now, target, latest);
}

void OffloadRuns::RestoreHostCopyLocked(
    const std::shared_ptr<VersionRun>& run,
    std::shared_ptr<const StreamPlan> now, int32_t target) {
  InstanceRun& inst = run->instances[0];
  const std::string stream = run->stream, id = inst.id;
  const KeptCopy copy = run->copy;
  const std::vector<std::shared_ptr<const Participant>> ranks =
      now->instances[target].ranks;
  run->plan = std::move(now);
  run->version = copy.version;
  run->from_host_copy = true;
  inst.planned = target;
  inst.ranks = ranks;
  inst.phase = RunPhase::kTransfer;
  inst.transfer_started_at = absl::Now();
  run->first_byte_at = absl::Now();
  std::shared_ptr<TransferProgress> progress = inst.progress;
  progress->bytes_total.store(copy.bytes);
  driver_->Record(*run, inst);
  ++run->transfers_in_flight;
  std::vector<HostCopy::Rank> here;
  for (const auto& r : ranks) {
    if (r->memory->mapped()) here.push_back(HostCopyRank(*r));
  }
  mu_.Unlock();
  absl::Status s =
      copy.local == nullptr
          ? absl::OkStatus()
          : copy.local->Restore(here, devices_, &progress->cancel);
  if (s.ok()) {
    s = ManageMembers(copy.members, v1::MEMORY_ACTION_RESTORE, 0).status();
  }
  mu_.Lock();
  --run->transfers_in_flight;
  if (inst.phase != RunPhase::kTransfer) return;  // aborted meanwhile
  if (!s.ok()) {
    driver_->Abort(*run, inst, AbortCause::kTransfer,
                   absl::StrCat("restoring the host copy: ", s.message()));
    return;
  }
  progress->bytes_moved.store(copy.bytes);
  inst.transfer_clean = true;
  inst.transfer_done_at = absl::Now();
  inst.phase = RunPhase::kApply;
  driver_->Apply(*run, inst);
  LOG(INFO) << "stream " << stream << ": instance " << id << " restored "
            << copy.bytes << " bytes of version " << copy.version
            << " from its host copy";
  driver_->Advance(run);
}

void OffloadRuns::RefillFromPeerLocked(
    const std::shared_ptr<VersionRun>& run,
    const std::shared_ptr<const StreamPlan>& now, int32_t target,
    int64_t latest) {
  InstanceRun& inst = run->instances[0];
  const std::string stream = run->stream, id = inst.id;
  const KeptCopy copy = run->copy;
  const std::string no_copy =
      !copy.kept ? std::string("no host copy was kept")
                 : absl::StrCat("its host copy holds version ", copy.version);
  std::string why;
  const int32_t donor =
      latest == 0 ? -1 : driver_->ChooseDonor(*now, target, latest, &why);
  if (donor < 0) {
    driver_->Abort(
        *run, inst, AbortCause::kNoCopy,
        absl::StrCat("onloaded without the stream's latest committed version ",
                     latest, ": ", no_copy,
                     latest == 0 ? std::string() : absl::StrCat("; ", why),
                     "; it is filled by the stream's next version"));
    return;
  }
  const std::string donor_id = now->instances[donor].id;
  ++run->transfers_in_flight;
  mu_.Unlock();
  absl::StatusOr<std::shared_ptr<const StreamPlan>> donor_plan =
      BuildDonorPlan(*now, donor, target);
  mu_.Lock();
  --run->transfers_in_flight;
  if (inst.phase != RunPhase::kPaused) return;
  if (!donor_plan.ok()) {
    driver_->Abort(*run, inst, AbortCause::kPlan,
                   absl::StrCat("no onload from ", donor_id, ": ",
                                donor_plan.status().message()));
    return;
  }
  run->plan = *std::move(donor_plan);
  run->donor = donor_id;
  run->version = latest;
  const PlannedInstance& pi = run->plan->instances[0];
  inst.planned = 0;
  inst.ranks = pi.ranks;
  if (pi.plan_index >= 0) {
    inst.progress->bytes_total.store(
        run->plan->plan.instances[pi.plan_index].bytes);
  }
  absl::Status s = driver_->ReserveStaging(*run, inst);
  if (!s.ok()) {
    driver_->Abort(*run, inst, AbortCause::kStaging,
                   absl::StrCat(absl::StatusCodeToString(s.code()), ": ",
                                s.message()));
    return;
  }
  LOG(INFO) << "stream " << stream << ": onload of instance " << id
            << " from peer instance " << donor_id << " at version " << latest
            << " (" << no_copy << ")";
  inst.paused_at = absl::Now();
  driver_->QueueTransfer(TransferTicket{run, 0, absl::Now()});
  driver_->Record(*run, inst);
  changed_.SignalAll();
}

std::string OffloadRuns::RegionsFixed(const Participant& p) const {
  absl::MutexLock lock(&mu_);
  if (offloaded_.count(p.instance_id)) return "";
  const StreamState* st = driver_->FindStream(p.stream);
  if (st != nullptr && st->delivery != nullptr) {
    const VersionRun& run = *st->delivery;
    if (run.kind == RunKind::kOnload && run.instances[0].id == p.instance_id &&
        run.instances[0].phase == RunPhase::kOnload) {
      return "";
    }
  }
  return absl::StrCat(
      "instance ", p.instance_id, " is not offloaded: a rank's regions "
      "change only while its instance is offloaded or answering ONLOAD (new "
      "memory or a new layout otherwise needs Lifecycle.SwapModel)");
}

}  // namespace ferry
