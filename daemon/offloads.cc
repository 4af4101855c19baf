// VersionCoordinator, offload and onload (Lifecycle.Offload / Onload), as
// version_coordinator.h describes: one-instance runs in the stream's
// delivery slot, driven by the Lifecycle call's thread between the phases
// the ranks' acks move.
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/peer_plan.h"
#include "daemon/version_coordinator.h"
#include "glog/logging.h"

namespace ferry {
namespace {

// MemAvailable of /proc/meminfo in bytes; -1 when it cannot be read.
int64_t MemAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t kib = -1;
    fields >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

}  // namespace

std::string VersionCoordinator::LifecycleBlockedLocked(
    const std::string& stream) const {
  if (shutting_down_) return "ferryd is shutting down";
  auto it = streams_.find(stream);
  if (it == streams_.end()) return "";
  const StreamState& st = it->second;
  if (st.current != nullptr) {
    return absl::StrCat("version ", st.current->version,
                        " is in progress on stream ", stream);
  }
  if (st.delivery != nullptr) {
    return absl::StrCat("the ", DeliveryKindName(st.delivery->kind),
                        " of instance ", st.delivery->instances[0].id,
                        " is in progress on stream ", stream);
  }
  return "";
}

std::shared_ptr<VersionCoordinator::VersionRun>
VersionCoordinator::StartLifecycleRunLocked(
    std::shared_ptr<const StreamPlan> plan, int32_t target, RunKind kind,
    int64_t version) {
  auto run = std::make_shared<VersionRun>();
  run->serial = next_run_serial_++;
  run->kind = kind;
  run->stream = plan->stream;
  run->version = version;
  run->plan = std::move(plan);
  run->world_size = 0;  // no sources
  run->begun_at = absl::Now();
  run->deadline = clock_->Now() + options_.version_timeout;
  if (metrics_ != nullptr) {
    metrics_->VersionBegun(run->stream, DeliveryKindName(kind));
  }
  run->instances.push_back(NewInstanceRunLocked(*run->plan, target));
  streams_[run->stream].delivery = run;
  return run;
}

void VersionCoordinator::WaitWhileLocked(const VersionRun& run, Phase phase) {
  // The phase's acks have deadlines (the deadline thread aborts what is
  // late), so this ends.
  while (!run.settled && run.instances[0].phase == phase) {
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
}

absl::StatusOr<v1::InstanceStatus> VersionCoordinator::Offload(
    const std::string& stream, const std::string& instance_id,
    bool keep_host_copy, const Expired& expired) {
  const std::string what = absl::StrCat("Offload(", instance_id, ")");
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  const int32_t target = (*plan)->FindInstance(instance_id);
  if (target < 0) {
    return absl::NotFoundError(absl::StrCat(
        what, ": stream ", stream, " has no complete instance ", instance_id,
        " (every tp rank registered)"));
  }
  int64_t bytes = 0;
  for (const auto& r : (*plan)->instances[target].ranks) {
    if (r->memory == nullptr || !r->memory->mapped()) {
      return absl::UnimplementedError(absl::StrCat(
          what, ": tp rank ", r->tp_rank, " is on node ", r->node,
          ", a member daemon's; offloading an instance on a member's node "
          "is not built yet"));
    }
    bytes += r->memory->total_bytes();
  }
  if (keep_host_copy) {
    const int64_t available = MemAvailableBytes();
    if (available >= 0 && bytes > available) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": the host copy needs ", bytes, " bytes and the kernel "
          "reports ", available, " available; nothing was changed "
          "(keep_host_copy false discards the weights instead)"));
    }
  }

  absl::MutexLock lock(&mu_);
  if (offloaded_.count(instance_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the instance is already offloaded"));
  }
  const std::string blocked = LifecycleBlockedLocked(stream);
  if (!blocked.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", blocked));
  }
  auto rec = records_.find(instance_id);
  if (keep_host_copy && rec != records_.end() && rec->second.dirty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the instance is dirty (", rec->second.abort_reason(),
        "): its weights are no one version, so a host copy would restore "
        "nothing; offload with keep_host_copy false, or ReloadInPlace "
        "first"));
  }
  int64_t held = 0;
  if (rec != records_.end()) {
    held = rec->second.committed_version();
  } else {
    held = (*plan)->instances[target].ranks[0]->held_version;
    for (const auto& r : (*plan)->instances[target].ranks) {
      held = std::min(held, r->held_version);
    }
  }
  std::shared_ptr<VersionRun> run =
      StartLifecycleRunLocked(*plan, target, RunKind::kOffload, held);
  InstanceRun& inst = run->instances[0];
  LOG(INFO) << "stream " << stream << ": offload of instance " << instance_id
            << " at version " << held
            << (keep_host_copy ? absl::StrCat(", keeping a host copy of ",
                                              bytes, " bytes")
                               : std::string(", discarding its weights"));
  inst.phase = Phase::kPause;
  inst.pause_sent_at = absl::Now();
  SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_PAUSE);
  SyncRecordLocked(*run, inst);
  changed_.SignalAll();  // the ranks' Subscribe streams send it
  WaitWhileLocked(*run, Phase::kPause);

  if (inst.phase == Phase::kPaused && keep_host_copy) {
    // Copied without the lock; the run stays open meanwhile, and a rank
    // lost during the copy cancels it (AbortInstanceLocked).
    ++run->transfers_in_flight;
    inst.transfer_started_at = absl::Now();
    const std::vector<std::shared_ptr<const Participant>> ranks = inst.ranks;
    std::shared_ptr<TransferProgress> progress = inst.progress;
    progress->bytes_total.store(bytes);
    mu_.Unlock();
    absl::StatusOr<std::unique_ptr<HostCopy>> copy =
        HostCopy::Take(ranks, held, options_.devices, &progress->cancel);
    mu_.Lock();
    --run->transfers_in_flight;
    inst.transfer_done_at = absl::Now();
    if (!copy.ok()) {
      // Only read so far: the ranks still hold their weights (clean).
      AbortInstanceLocked(*run, inst,
                          absl::IsResourceExhausted(copy.status())
                              ? AbortCause::kStaging
                              : AbortCause::kTransfer,
                          absl::StrCat("host copy: ", copy.status().message()));
    } else if (inst.phase == Phase::kPaused) {
      run->host_copy = *std::move(copy);
      progress->bytes_moved.store(run->host_copy->bytes());
    }
  }
  if (inst.phase == Phase::kPaused) {
    inst.phase = Phase::kOffload;
    inst.waiting_kind = v1::UPDATE_EVENT_KIND_OFFLOAD;
    inst.waiting_event.assign(inst.ranks.size(), 0);
    inst.ack_deadline = clock_->Now() + options_.ack_timeout;
    for (size_t r = 0; r < inst.ranks.size(); ++r) {
      v1::UpdateEvent e;
      e.set_kind(v1::UPDATE_EVENT_KIND_OFFLOAD);
      for (uint32_t id : inst.ranks[r]->memory->ids()) {
        e.mutable_offload()->add_region_ids(id);
      }
      e.mutable_offload()->set_host_copy_kept(run->host_copy != nullptr);
      PostLocked(*run, inst, r, std::move(e), /*needs_ack=*/true);
    }
    SyncRecordLocked(*run, inst);
  }
  AdvanceLocked(run);
  while (!run->settled) {
    if (expired && expired()) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the call's deadline passed before the offload settled; "
          "ListStreams shows its outcome"));
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
  return StatusLocked(*run, inst);
}

void VersionCoordinator::FinishOffloadLocked(const VersionRun& run,
                                             const InstanceRun& inst) {
  Offloaded& o = offloaded_[inst.id];
  o.stream = run.stream;
  o.copy = run.host_copy;
  o.rank_ids.clear();
  for (const auto& r : inst.ranks) {
    if (!r->removed.load()) o.rank_ids.insert(r->id);
    // Plans and the run history keep the participant; its memory goes now.
    r->memory->Release();
  }
}

absl::StatusOr<v1::InstanceStatus> VersionCoordinator::Onload(
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
  const std::string blocked = LifecycleBlockedLocked(stream);
  if (!blocked.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", blocked));
  }
  const int64_t held = records_[instance_id].committed_version();
  std::shared_ptr<VersionRun> run =
      StartLifecycleRunLocked(*plan, target, RunKind::kOnload, held);
  run->host_copy = off->second.copy;
  // From here the instance is being onloaded: whatever happens it ends
  // COMMITTED or ABORTED (dirty), never offloaded again.
  offloaded_.erase(off);
  InstanceRun& inst = run->instances[0];
  LOG(INFO) << "stream " << stream << ": onload of instance " << instance_id;
  inst.phase = Phase::kOnload;
  inst.waiting_kind = v1::UPDATE_EVENT_KIND_ONLOAD;
  inst.waiting_event.assign(inst.ranks.size(), 0);
  inst.ack_deadline = clock_->Now() + options_.ack_timeout;
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    v1::UpdateEvent e;
    e.set_kind(v1::UPDATE_EVENT_KIND_ONLOAD);
    for (uint32_t id : inst.ranks[r]->memory->ids()) {
      e.mutable_onload()->add_region_ids(id);
    }
    PostLocked(*run, inst, r, std::move(e), /*needs_ack=*/true);
  }
  SyncRecordLocked(*run, inst);
  changed_.SignalAll();  // the ranks' Subscribe streams send it
  WaitWhileLocked(*run, Phase::kOnload);
  if (inst.phase == Phase::kPaused) RefillOnloadLocked(run);
  MaybeSettleLocked(*run);
  while (!run->settled) {
    if (expired && expired()) {
      return absl::DeadlineExceededError(absl::StrCat(
          what, ": the call's deadline passed before the onload settled; "
          "ListStreams shows its outcome"));
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
  return StatusLocked(*run, inst);
}

void VersionCoordinator::RefillOnloadLocked(
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
  if (inst.phase != Phase::kPaused) return;  // aborted meanwhile
  const int32_t target = now.ok() ? (*now)->FindInstance(id) : -1;
  if (target < 0) {
    AbortInstanceLocked(*run, inst, AbortCause::kRankLost,
                        now.ok() ? std::string("a tp rank left during the "
                                               "onload")
                                 : std::string(now.status().message()));
    return;
  }
  const std::vector<std::shared_ptr<const Participant>> ranks =
      (*now)->instances[target].ranks;
  for (const auto& r : ranks) {
    if (r->memory->released()) {
      AbortInstanceLocked(
          *run, inst, AbortCause::kRankFailed,
          absl::StrCat("tp rank ", r->tp_rank, " acked ONLOAD without "
                       "registering its regions again "
                       "(Registry.UpdateRegions)"));
      return;
    }
  }
  const int64_t latest = streams_[stream].latest_committed;
  std::shared_ptr<const HostCopy> copy = run->host_copy;

  if (copy != nullptr && copy->version() >= latest) {
    run->plan = *now;
    run->version = copy->version();
    run->from_host_copy = true;
    inst.planned = target;
    inst.ranks = ranks;
    inst.phase = Phase::kTransfer;
    inst.transfer_started_at = absl::Now();
    run->first_byte_at = absl::Now();
    std::shared_ptr<TransferProgress> progress = inst.progress;
    progress->bytes_total.store(copy->bytes());
    SyncRecordLocked(*run, inst);
    ++run->transfers_in_flight;
    mu_.Unlock();
    absl::Status s = copy->Restore(ranks, options_.devices, &progress->cancel);
    mu_.Lock();
    --run->transfers_in_flight;
    if (inst.phase != Phase::kTransfer) return;  // aborted meanwhile
    if (!s.ok()) {
      AbortInstanceLocked(*run, inst, AbortCause::kTransfer,
                          absl::StrCat("restoring the host copy: ",
                                       s.message()));
      return;
    }
    progress->bytes_moved.store(copy->bytes());
    inst.transfer_clean = true;
    inst.transfer_done_at = absl::Now();
    inst.phase = Phase::kApply;
    SendApplyLocked(*run, inst);
    LOG(INFO) << "stream " << stream << ": instance " << id << " restored "
              << copy->bytes() << " bytes of version " << copy->version()
              << " from its host copy";
    AdvanceLocked(run);
    return;
  }

  const std::string no_copy =
      copy == nullptr
          ? std::string("no host copy was kept")
          : absl::StrCat("its host copy holds version ", copy->version());
  std::string why;
  const int32_t peer =
      latest == 0 ? -1 : ChoosePeerLocked(**now, target, latest, &why);
  if (peer < 0) {
    AbortInstanceLocked(
        *run, inst, AbortCause::kNoCopy,
        absl::StrCat("onloaded without the stream's latest committed version ",
                     latest, ": ", no_copy,
                     latest == 0 ? std::string() : absl::StrCat("; ", why),
                     "; it is filled by the stream's next version"));
    return;
  }
  const std::string peer_id = (*now)->instances[peer].id;
  ++run->transfers_in_flight;
  mu_.Unlock();
  absl::StatusOr<std::shared_ptr<const StreamPlan>> peer_plan =
      BuildPeerPlan(**now, peer, target);
  mu_.Lock();
  --run->transfers_in_flight;
  if (inst.phase != Phase::kPaused) return;
  if (!peer_plan.ok()) {
    AbortInstanceLocked(*run, inst, AbortCause::kPlan,
                        absl::StrCat("no onload from ", peer_id, ": ",
                                     peer_plan.status().message()));
    return;
  }
  run->plan = *std::move(peer_plan);
  run->peer = peer_id;
  run->version = latest;
  const PlannedInstance& pi = run->plan->instances[0];
  inst.planned = 0;
  inst.ranks = pi.ranks;
  if (pi.plan_index >= 0) {
    inst.progress->bytes_total.store(
        run->plan->direct_plan().instances[pi.plan_index].bytes);
  }
  absl::Status s = ReserveStagingLocked(*run, inst);
  if (!s.ok()) {
    AbortInstanceLocked(*run, inst, AbortCause::kStaging,
                        absl::StrCat(absl::StatusCodeToString(s.code()), ": ",
                                     s.message()));
    return;
  }
  LOG(INFO) << "stream " << stream << ": onload of instance " << id
            << " from peer instance " << peer_id << " at version " << latest
            << " (" << no_copy << ")";
  inst.paused_at = absl::Now();
  transfers_.push_back(TransferTicket{run, 0, absl::Now()});
  SyncRecordLocked(*run, inst);
  changed_.SignalAll();
}

std::string VersionCoordinator::RegionsFixed(const Participant& p) const {
  absl::MutexLock lock(&mu_);
  if (offloaded_.count(p.instance_id)) return "";
  auto it = streams_.find(p.stream);
  if (it != streams_.end() && it->second.delivery != nullptr) {
    const VersionRun& run = *it->second.delivery;
    if (run.kind == RunKind::kOnload && run.instances[0].id == p.instance_id &&
        run.instances[0].phase == Phase::kOnload) {
      return "";
    }
  }
  return absl::StrCat(
      "instance ", p.instance_id, " is not offloaded: a rank's regions "
      "change only while its instance is offloaded or answering ONLOAD (new "
      "memory or a new layout otherwise needs Lifecycle.SwapModel)");
}

VersionCoordinator::HostCopyInfo VersionCoordinator::HostCopyOf(
    const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  HostCopyInfo info;
  auto it = offloaded_.find(instance_id);
  if (it != offloaded_.end() && it->second.copy != nullptr) {
    info.bytes = it->second.copy->bytes();
    info.version = it->second.copy->version();
  }
  return info;
}

}  // namespace ferry
