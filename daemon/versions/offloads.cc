// VersionCoordinator, offload and onload (Lifecycle.Offload / Onload), as
// version_coordinator.h describes: one-instance runs in the stream's
// delivery slot, driven by the Lifecycle call's thread between the phases
// the ranks' acks move.
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/plans/peer_plan.h"
#include "daemon/versions/version_coordinator.h"
#include "glog/logging.h"

namespace ferry {
namespace {

// The rank as a host copy knows it.
HostCopy::Rank HostCopyRank(const Participant& p) {
  return HostCopy::Rank{p.id, p.Describe(), p.memory};
}

}  // namespace

std::shared_ptr<VersionRun>
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
    metrics_->VersionBegun(run->stream, RunKindName(kind));
  }
  run->instances.push_back(NewInstanceRunLocked(*run->plan, target));
  streams_[run->stream].delivery = run;
  return run;
}

void VersionCoordinator::WaitWhileLocked(const VersionRun& run, RunPhase phase) {
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
  // Ranks on this node are copied here; those on a member's node by that
  // member (Peer.ManageMemory), which checks its own memory.
  int64_t bytes = 0;
  std::vector<HostCopy::Rank> local;
  std::map<std::string, std::vector<std::string>> members;
  for (const auto& r : (*plan)->instances[target].ranks) {
    if (r->memory != nullptr && r->memory->mapped()) {
      local.push_back(HostCopyRank(*r));
      bytes += r->memory->total_bytes();
    } else if (!remote_memory_) {
      return absl::UnimplementedError(absl::StrCat(
          what, ": tp rank ", r->tp_rank, " is on node ", r->node,
          ", and this daemon has no path to members' memory"));
    } else {
      members[r->node].push_back(r->id);
    }
  }
  if (keep_host_copy) {
    const int64_t available = AvailableHostMemory();
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
  const std::string blocked = BusyLocked(stream, /*instance_id=*/"");
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
            << (keep_host_copy
                    ? absl::StrCat(", keeping a host copy (", bytes,
                                   " bytes of ranks on this node",
                                   members.empty()
                                       ? std::string()
                                       : absl::StrCat("; the ranks on ",
                                                      members.size(),
                                                      " members' nodes are "
                                                      "copied there"),
                                   ")")
                    : std::string(", discarding its weights"));
  inst.phase = RunPhase::kPause;
  inst.pause_sent_at = absl::Now();
  SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_PAUSE);
  SyncRecordLocked(*run, inst);
  changed_.SignalAll();  // the ranks' Subscribe streams send it
  WaitWhileLocked(*run, RunPhase::kPause);

  bool members_copied = false;
  if (inst.phase == RunPhase::kPaused && keep_host_copy) {
    // Copied without the lock; the run stays open meanwhile, and a rank
    // lost during the copy cancels it (AbortInstanceLocked).
    ++run->transfers_in_flight;
    inst.transfer_started_at = absl::Now();
    std::shared_ptr<TransferProgress> progress = inst.progress;
    progress->bytes_total.store(bytes);
    mu_.Unlock();
    absl::StatusOr<std::unique_ptr<HostCopy>> copy =
        local.empty() ? absl::StatusOr<std::unique_ptr<HostCopy>>(nullptr)
                      : HostCopy::Take(local, held, options_.devices,
                                       &progress->cancel);
    absl::StatusOr<int64_t> remote_bytes =
        copy.ok() ? ManageMembers(members, v1::MEMORY_ACTION_COPY, held)
                  : absl::StatusOr<int64_t>(0);
    mu_.Lock();
    --run->transfers_in_flight;
    inst.transfer_done_at = absl::Now();
    members_copied = !members.empty();
    const absl::Status failed =
        !copy.ok() ? copy.status() : remote_bytes.status();
    if (!failed.ok()) {
      // Only read so far: the ranks still hold their weights (clean).
      AbortInstanceLocked(*run, inst,
                          absl::IsResourceExhausted(failed)
                              ? AbortCause::kStaging
                              : AbortCause::kTransfer,
                          absl::StrCat("host copy: ", failed.message()));
    } else if (inst.phase == RunPhase::kPaused) {
      run->copy.kept = true;
      run->copy.version = held;
      run->copy.local = std::move(*copy);
      run->copy.members = members;
      run->copy.bytes = (run->copy.local ? run->copy.local->bytes() : 0) +
                        *remote_bytes;
      progress->bytes_moved.store(run->copy.bytes);
    }
  }
  if (inst.phase == RunPhase::kPaused) {
    inst.phase = RunPhase::kOffload;
    const bool kept = run->copy.kept;
    SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_OFFLOAD,
                    [kept](const Participant& p, v1::UpdateEvent* e) {
                      for (uint32_t id : p.memory->ids()) {
                        e->mutable_offload()->add_region_ids(id);
                      }
                      e->mutable_offload()->set_host_copy_kept(kept);
                    });
    SyncRecordLocked(*run, inst);
  }
  AdvanceLocked(run);
  // Not cut short by the caller's deadline: the members' maps are released
  // (or their copies dropped) below, once the run settled, which its ack
  // deadlines bound.
  while (!run->settled) changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  const bool offloaded = inst.phase == RunPhase::kOffloaded;
  const v1::InstanceStatus status = StatusLocked(*run, inst);
  if (offloaded || members_copied) {
    TellMembersLocked(members,
                      offloaded ? v1::MEMORY_ACTION_RELEASE
                                : v1::MEMORY_ACTION_DROP,
                      what);
  }
  if (expired && expired()) {
    return absl::DeadlineExceededError(absl::StrCat(
        what, ": the call's deadline passed before the offload settled; "
        "ListStreams shows its outcome"));
  }
  return status;
}

void VersionCoordinator::TellMembersLocked(
    const std::map<std::string, std::vector<std::string>>& members,
    v1::MemoryAction action, const std::string& what) {
  if (members.empty()) return;
  const std::map<std::string, std::vector<std::string>> copy = members;
  mu_.Unlock();
  absl::StatusOr<int64_t> done = ManageMembers(copy, action, 0);
  mu_.Lock();
  if (!done.ok()) {
    LOG(WARNING) << what << ": " << done.status()
                 << " (the member keeps that memory until its ranks leave)";
  }
}

absl::StatusOr<int64_t> VersionCoordinator::ManageMembers(
    const std::map<std::string, std::vector<std::string>>& members,
    v1::MemoryAction action, int64_t version) {
  int64_t bytes = 0;
  for (const auto& [node, ids] : members) {
    v1::ManageMemoryRequest request;
    request.set_action(action);
    request.set_version(version);
    for (const std::string& id : ids) request.add_participant_ids(id);
    absl::StatusOr<v1::ManageMemoryResponse> b = remote_memory_(node, request);
    if (!b.ok()) return b.status();
    bytes += b->bytes();
  }
  return bytes;
}

void VersionCoordinator::FinishOffloadLocked(const VersionRun& run,
                                             const InstanceRun& inst) {
  Offloaded& o = offloaded_[inst.id];
  o.stream = run.stream;
  o.copy = run.copy;
  o.rank_ids.clear();
  for (const auto& r : inst.ranks) {
    if (!r->removed.load()) o.rank_ids.insert(r->id);
    // Plans and the run history keep the participant; its memory goes now
    // (ranks on members: their member releases it, Offload's caller asks).
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
  const std::string blocked = BusyLocked(stream, /*instance_id=*/"");
  if (!blocked.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", blocked));
  }
  const int64_t held = records_[instance_id].committed_version();
  std::shared_ptr<VersionRun> run =
      StartLifecycleRunLocked(*plan, target, RunKind::kOnload, held);
  run->copy = off->second.copy;
  // From here the instance is being onloaded: whatever happens it ends
  // COMMITTED or ABORTED (dirty), never offloaded again.
  offloaded_.erase(off);
  InstanceRun& inst = run->instances[0];
  LOG(INFO) << "stream " << stream << ": onload of instance " << instance_id;
  inst.phase = RunPhase::kOnload;
  SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_ONLOAD,
                  [](const Participant& p, v1::UpdateEvent* e) {
                    for (uint32_t id : p.memory->ids()) {
                      e->mutable_onload()->add_region_ids(id);
                    }
                  });
  SyncRecordLocked(*run, inst);
  changed_.SignalAll();  // the ranks' Subscribe streams send it
  WaitWhileLocked(*run, RunPhase::kOnload);
  if (inst.phase == RunPhase::kPaused) RefillOnloadLocked(run);
  MaybeSettleLocked(*run);
  // Not cut short by the caller's deadline: the members' copies are
  // dropped below, once the run settled (its deadlines bound it).
  while (!run->settled) changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  const v1::InstanceStatus status = StatusLocked(*run, inst);
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
  if (inst.phase != RunPhase::kPaused) return;  // aborted meanwhile
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
  const KeptCopy copy = run->copy;

  if (copy.kept && copy.version >= latest) {
    run->plan = *now;
    run->version = copy.version;
    run->from_host_copy = true;
    inst.planned = target;
    inst.ranks = ranks;
    inst.phase = RunPhase::kTransfer;
    inst.transfer_started_at = absl::Now();
    run->first_byte_at = absl::Now();
    std::shared_ptr<TransferProgress> progress = inst.progress;
    progress->bytes_total.store(copy.bytes);
    SyncRecordLocked(*run, inst);
    ++run->transfers_in_flight;
    std::vector<HostCopy::Rank> here;
    for (const auto& r : ranks) {
      if (r->memory->mapped()) here.push_back(HostCopyRank(*r));
    }
    mu_.Unlock();
    absl::Status s =
        copy.local == nullptr
            ? absl::OkStatus()
            : copy.local->Restore(here, options_.devices, &progress->cancel);
    if (s.ok()) {
      s = ManageMembers(copy.members, v1::MEMORY_ACTION_RESTORE, 0).status();
    }
    mu_.Lock();
    --run->transfers_in_flight;
    if (inst.phase != RunPhase::kTransfer) return;  // aborted meanwhile
    if (!s.ok()) {
      AbortInstanceLocked(*run, inst, AbortCause::kTransfer,
                          absl::StrCat("restoring the host copy: ",
                                       s.message()));
      return;
    }
    progress->bytes_moved.store(copy.bytes);
    inst.transfer_clean = true;
    inst.transfer_done_at = absl::Now();
    inst.phase = RunPhase::kApply;
    SendApplyLocked(*run, inst);
    LOG(INFO) << "stream " << stream << ": instance " << id << " restored "
              << copy.bytes << " bytes of version " << copy.version
              << " from its host copy";
    AdvanceLocked(run);
    return;
  }

  const std::string no_copy =
      !copy.kept ? std::string("no host copy was kept")
                 : absl::StrCat("its host copy holds version ", copy.version);
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
  if (inst.phase != RunPhase::kPaused) return;
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
        run->plan->plan.instances[pi.plan_index].bytes);
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
  QueueTransferLocked(TransferTicket{run, 0, absl::Now()});
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
        run.instances[0].phase == RunPhase::kOnload) {
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
  if (it != offloaded_.end() && it->second.copy.kept) {
    info.bytes = it->second.copy.bytes;
    info.version = it->second.copy.version;
  }
  return info;
}

}  // namespace ferry
