// OffloadRuns (offload_runs.h), offload (Lifecycle.Offload), and what
// offload and onload (onloads.cc) share: the members' memory
// (Peer.ManageMemory); an offloaded instance, its host copy and its ranks.
#include "daemon/versions/offload_runs.h"

#include <algorithm>
#include <map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ferry {
namespace {

// What an offload copies: the instance's ranks on this node (copied here,
// `bytes` of them) and those on members' nodes (by their member, which
// checks its own memory).
struct OffloadRanks {
  int32_t target = -1;  // index into the plan's instances
  int64_t bytes = 0;
  std::vector<HostCopy::Rank> local;
  std::map<std::string, std::vector<std::string>> members;  // node -> ids
};

// The ranks of `instance_id` an offload copies, or why it cannot start:
// NOT_FOUND (incomplete instance), UNIMPLEMENTED (a rank on a member
// without `members_reachable`), RESOURCE_EXHAUSTED (the host copy would
// not fit in the memory the kernel reports available).
absl::StatusOr<OffloadRanks> RanksToOffload(const StreamPlan& plan,
                                            const std::string& what,
                                            const std::string& instance_id,
                                            bool keep_host_copy,
                                            bool members_reachable) {
  OffloadRanks out;
  out.target = plan.FindInstance(instance_id);
  if (out.target < 0) {
    return absl::NotFoundError(absl::StrCat(
        what, ": stream ", plan.stream, " has no complete instance ",
        instance_id, " (every tp rank registered)"));
  }
  // Ranks on this node are copied here; those on a member's node by that
  // member (Peer.ManageMemory), which checks its own memory.
  for (const auto& r : plan.instances[out.target].ranks) {
    if (r->memory != nullptr && r->memory->mapped()) {
      out.local.push_back(HostCopyRank(*r));
      out.bytes += r->memory->total_bytes();
    } else if (!members_reachable) {
      return absl::UnimplementedError(absl::StrCat(
          what, ": tp rank ", r->tp_rank, " is on node ", r->node,
          ", and this daemon has no path to members' memory"));
    } else {
      out.members[r->node].push_back(r->id);
    }
  }
  if (keep_host_copy) {
    const int64_t available = AvailableHostMemory();
    if (available >= 0 && out.bytes > available) {
      return absl::ResourceExhaustedError(absl::StrCat(
          what, ": the host copy needs ", out.bytes, " bytes and the kernel "
          "reports ", available, " available; nothing was changed "
          "(keep_host_copy false discards the weights instead)"));
    }
  }
  return out;
}

}  // namespace

OffloadRuns::OffloadRuns(absl::Mutex& mu, absl::CondVar& changed,
                         RunDriver* driver, PlanCache* plans,
                         DeviceMemory* devices)
    : mu_(mu),
      changed_(changed),
      driver_(driver),
      plans_(plans),
      devices_(devices) {}

absl::StatusOr<v1::InstanceStatus> OffloadRuns::Offload(
    const std::string& stream, const std::string& instance_id,
    bool keep_host_copy, const Expired& expired) {
  const std::string what = absl::StrCat("Offload(", instance_id, ")");
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  absl::StatusOr<OffloadRanks> ranks =
      RanksToOffload(**plan, what, instance_id, keep_host_copy,
                     static_cast<bool>(remote_memory_));
  if (!ranks.ok()) return ranks.status();
  const int32_t target = ranks->target;
  const int64_t bytes = ranks->bytes;
  const std::map<std::string, std::vector<std::string>>& members =
      ranks->members;

  absl::MutexLock lock(&mu_);
  if (offloaded_.count(instance_id)) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": the instance is already offloaded"));
  }
  const std::string blocked = driver_->Busy(stream, /*instance_id=*/"");
  if (!blocked.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(what, ": ", blocked));
  }
  const v1::InstanceStatus* rec = driver_->FindRecord(instance_id);
  if (keep_host_copy && rec != nullptr && rec->dirty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        what, ": the instance is dirty (", rec->abort_reason(),
        "): its weights are no one version, so a host copy would restore "
        "nothing; offload with keep_host_copy false, or ReloadInPlace "
        "first"));
  }
  int64_t held = 0;
  if (rec != nullptr) {
    held = rec->committed_version();
  } else {
    held = (*plan)->instances[target].ranks[0]->held_version;
    for (const auto& r : (*plan)->instances[target].ranks) {
      held = std::min(held, r->held_version);
    }
  }
  std::shared_ptr<VersionRun> run =
      driver_->StartSlotRun(*plan, target, RunKind::kOffload, held,
                            /*donor=*/"");
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
  driver_->Send(*run, inst, v1::UPDATE_EVENT_KIND_PAUSE, nullptr);
  driver_->Record(*run, inst);
  changed_.SignalAll();  // the ranks' Subscribe streams send it
  driver_->WaitWhile(*run, RunPhase::kPause);

  bool members_copied = false;
  if (inst.phase == RunPhase::kPaused && keep_host_copy) {
    TakeHostCopyLocked(*run, ranks->local, members, bytes);
    members_copied = !members.empty();
  }
  if (inst.phase == RunPhase::kPaused) {
    inst.phase = RunPhase::kOffload;
    const bool kept = run->copy.kept;
    driver_->Send(*run, inst, v1::UPDATE_EVENT_KIND_OFFLOAD,
                  [kept](const Participant& p, v1::UpdateEvent* e) {
                    for (uint32_t id : p.memory->ids()) {
                      e->mutable_offload()->add_region_ids(id);
                    }
                    e->mutable_offload()->set_host_copy_kept(kept);
                  });
    driver_->Record(*run, inst);
  }
  driver_->Advance(run);
  // Not cut short by the caller's deadline: the members' maps are released
  // (or their copies dropped) below, once the run settled, which its ack
  // deadlines bound.
  while (!run->settled) changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  const bool offloaded = inst.phase == RunPhase::kOffloaded;
  const v1::InstanceStatus status = driver_->Status(*run, inst);
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

void OffloadRuns::TakeHostCopyLocked(
    VersionRun& run, const std::vector<HostCopy::Rank>& local,
    const std::map<std::string, std::vector<std::string>>& members,
    int64_t bytes) {
  InstanceRun& inst = run.instances[0];
  const int64_t held = run.version;
  // Copied without the lock; the run stays open meanwhile, and a rank
  // lost during the copy cancels it (RunDriver::Abort).
  ++run.transfers_in_flight;
  inst.transfer_started_at = absl::Now();
  std::shared_ptr<TransferProgress> progress = inst.progress;
  progress->bytes_total.store(bytes);
  mu_.Unlock();
  absl::StatusOr<std::unique_ptr<HostCopy>> copy =
      local.empty() ? absl::StatusOr<std::unique_ptr<HostCopy>>(nullptr)
                    : HostCopy::Take(local, held, devices_,
                                     &progress->cancel);
  absl::StatusOr<int64_t> remote_bytes =
      copy.ok() ? ManageMembers(members, v1::MEMORY_ACTION_COPY, held)
                : absl::StatusOr<int64_t>(0);
  mu_.Lock();
  --run.transfers_in_flight;
  inst.transfer_done_at = absl::Now();
  const absl::Status failed =
      !copy.ok() ? copy.status() : remote_bytes.status();
  if (!failed.ok()) {
    // Only read so far: the ranks still hold their weights (clean).
    driver_->Abort(run, inst,
                   absl::IsResourceExhausted(failed) ? AbortCause::kStaging
                                                     : AbortCause::kTransfer,
                   absl::StrCat("host copy: ", failed.message()));
  } else if (inst.phase == RunPhase::kPaused) {
    run.copy.kept = true;
    run.copy.version = held;
    run.copy.local = std::move(*copy);
    run.copy.members = members;
    run.copy.bytes = (run.copy.local ? run.copy.local->bytes() : 0) +
                     *remote_bytes;
    progress->bytes_moved.store(run.copy.bytes);
  }
}

void OffloadRuns::TellMembersLocked(
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

absl::StatusOr<int64_t> OffloadRuns::ManageMembers(
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

void OffloadRuns::FinishOffloadLocked(const VersionRun& run,
                                      const InstanceRun& inst) {
  OffloadedInstance& o = offloaded_[inst.id];
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

OffloadRuns::HostCopyInfo OffloadRuns::HostCopyOf(
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

bool OffloadRuns::IsOffloaded(const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  return offloaded_.count(instance_id) > 0;
}

bool OffloadRuns::IsOffloadedLocked(const std::string& instance_id) const {
  return offloaded_.count(instance_id) > 0;
}

bool OffloadRuns::RankLeftLocked(const Participant& p) {
  auto off = offloaded_.find(p.instance_id);
  if (p.role != Role::kDestination || off == offloaded_.end()) return false;
  off->second.rank_ids.erase(p.id);
  if (!off->second.rank_ids.empty()) return false;
  offloaded_.erase(off);
  return true;
}

void OffloadRuns::RankJoinedLocked(const Participant& p) {
  auto off = offloaded_.find(p.instance_id);
  if (off != offloaded_.end()) off->second.rank_ids.insert(p.id);
}

}  // namespace ferry
