// VersionCoordinator, removal and deadlines: a rank that leaves mid-version,
// a rank that joins, and the thread that aborts an instance whose ack or
// version deadline passed.
#include "daemon/versions/version_coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {

void VersionCoordinator::OnParticipantRemoved(const Participant& p,
                                              const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(p.stream);
  if (it != streams_.end()) {
    // The version in progress and the peer delivery in progress: a lost
    // source (a trainer rank, or a rank of the peer a delivery reads)
    // aborts the run; a lost destination rank aborts its instance.
    for (std::shared_ptr<VersionRun> run :
         {it->second.current, it->second.delivery}) {
      if (run == nullptr) continue;
      for (const auto& s : run->plan->sources) {
        if (s == nullptr || s->id != p.id) continue;
        AbortRunLocked(
            *run, AbortCause::kSourceLost,
            run->kind == RunKind::kVersion
                ? absl::StrCat("source rank ", p.rank, " lost: ", why)
                : absl::StrCat("peer instance ", run->peer, " tp rank ",
                               p.tp_rank, " lost during the ",
                               DeliveryKindName(run->kind), ": ", why));
      }
      for (InstanceRun& inst : run->instances) {
        for (const auto& r : inst.ranks) {
          if (r->id == p.id) {
            AbortInstanceLocked(*run, inst, AbortCause::kRankLost,
                                absl::StrCat("tp rank ", p.tp_rank,
                                             " lost: ", why));
          }
        }
      }
      AdvanceLocked(run);
    }
  }
  // An offloaded instance whose every rank left takes its host copy along.
  auto off = offloaded_.find(p.instance_id);
  if (p.role == Role::kDestination && off != offloaded_.end()) {
    off->second.rank_ids.erase(p.id);
    if (off->second.rank_ids.empty()) {
      LOG(INFO) << "instance " << p.instance_id << ": every rank left while "
                << "offloaded; its host copy is dropped";
      offloaded_.erase(off);
      records_.erase(p.instance_id);
    }
  }
  channels_.erase(p.id);  // staging is freed once no transfer holds it
  changed_.SignalAll();
}

void VersionCoordinator::OnParticipantAdded(const Participant& p) {
  if (p.role != Role::kDestination) return;
  absl::MutexLock lock(&mu_);
  // Its instance may be complete now, and behind: the delivery thread
  // bootstraps it from a peer if one holds the stream's latest version.
  bootstrap_wanted_.insert(p.stream);
  changed_.SignalAll();
  auto off = offloaded_.find(p.instance_id);
  if (off != offloaded_.end()) off->second.rank_ids.insert(p.id);
  auto it = records_.find(p.instance_id);
  // An adapter's ranks are attached all at once (Registry::AttachAdapter):
  // a bootstrap that filled them may settle before the last one is
  // announced here, and that rank holds what the others hold.
  if (it == records_.end() || p.adapter != nullptr ||
      it->second.committed_version() <= p.held_version) {
    return;
  }
  v1::InstanceStatus& s = it->second;
  // Offloaded stays offloaded (its other ranks hold no memory) until
  // Lifecycle.Onload; its host copy may be older than the rank now.
  if (s.state() == v1::INSTANCE_STATE_OFFLOADED) return;
  LOG(INFO) << "instance " << p.instance_id << ": tp rank " << p.tp_rank
            << " registered holding version " << p.held_version
            << "; the instance no longer holds version "
            << s.committed_version();
  s.set_committed_version(p.held_version);
  if (s.state() != v1::INSTANCE_STATE_ABORTED) {
    s.set_state(v1::INSTANCE_STATE_IDLE);
    s.set_version(0);
  }
  changed_.SignalAll();
}

void VersionCoordinator::CheckDeadlinesLocked() {
  const absl::Time now = clock_->Now();
  std::vector<std::shared_ptr<VersionRun>> runs;
  for (auto& [name, st] : streams_) {
    if (st.current != nullptr) runs.push_back(st.current);
    if (st.delivery != nullptr) runs.push_back(st.delivery);
  }
  for (const auto& run : runs) {
    bool changed = false;
    for (InstanceRun& inst : run->instances) {
      if (inst.settled() || now <= inst.ack_deadline) continue;
      std::vector<size_t> late;
      for (size_t r = 0; r < inst.waiting_event.size(); ++r) {
        if (inst.waiting_event[r] != 0) late.push_back(r);
      }
      if (late.empty()) continue;
      AbortInstanceLocked(
          *run, inst, AbortCause::kAckTimeout,
          absl::StrCat("tp rank", late.size() > 1 ? "s " : " ",
                       absl::StrJoin(late, ", "), " did not ack ",
                       UpdateEventKindName(inst.waiting_kind), " within ",
                       absl::ToInt64Milliseconds(options_.ack_timeout),
                       " ms"));
      changed = true;
    }
    if (now > run->deadline) {
      const std::string limit = absl::StrCat(
          absl::ToInt64Milliseconds(options_.version_timeout),
          run->kind == RunKind::kVersion
              ? " ms of the first CommitVersion"
              : absl::StrCat(" ms of the ", DeliveryKindName(run->kind),
                             "'s start"));
      if (!run->all_committed()) {
        std::vector<int32_t> missing;
        for (int32_t r = 0; r < run->world_size; ++r) {
          if (!run->committed.count(r)) missing.push_back(r);
        }
        AbortRunLocked(*run, AbortCause::kVersionTimeout,
                       absl::StrCat("source ranks [",
                                          absl::StrJoin(missing, ", "),
                                          "] did not commit within ", limit));
      } else {
        for (InstanceRun& inst : run->instances) {
          if (inst.settled()) continue;
          AbortInstanceLocked(
              *run, inst, AbortCause::kVersionTimeout,
              absl::StrCat("version timeout: not settled within ", limit,
                           " (state ",
                           v1::InstanceState_Name(
                               StatusLocked(*run, inst).state()),
                           ")"));
        }
      }
      changed = true;
    }
    if (changed) AdvanceLocked(run);
  }
}

void VersionCoordinator::DeadlineLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    CheckDeadlinesLocked();
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
  }
}

}  // namespace ferry
