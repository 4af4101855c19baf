// VersionCoordinator as the Registry's listener (registry.h): a rank that
// leaves aborts what it took part in (a source: the whole run; a
// destination: its instance); a rank that joins may call for a bootstrap,
// and lowers its instance's committed_version when it holds less.
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/versions/version_coordinator.h"
#include "glog/logging.h"

namespace ferry {

void VersionCoordinator::OnParticipantRemoved(const Participant& p,
                                              const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(p.stream);
  if (it != streams_.end()) {
    // The version in progress and the donor delivery in progress: a lost
    // source (a trainer rank, or a rank of the donor a delivery reads)
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
                : absl::StrCat("peer instance ", run->donor, " tp rank ",
                               p.tp_rank, " lost during the ",
                               RunKindName(run->kind), ": ", why));
      }
      for (InstanceRun& inst : run->instances) {
        for (const auto& r : inst.ranks) {
          if (r->id == p.id) {
            Abort(*run, inst, AbortCause::kRankLost,
                  absl::StrCat("tp rank ", p.tp_rank, " lost: ", why));
          }
        }
      }
      Advance(run);
    }
  }
  // An offloaded instance whose every rank left takes its host copy along.
  offloads_.AssertHeld();  // mu_ is its lock
  if (offloads_.RankLeftLocked(p)) {
    LOG(INFO) << "instance " << p.instance_id << ": every rank left while "
              << "offloaded; its host copy is dropped";
    records_.erase(p.instance_id);
  }
  if (auto c = channels_.find(p.id); c != channels_.end()) {
    EndSubscriptionLocked(c->second,
                          absl::NotFoundError(absl::StrCat(
                              "participant ", p.id, ": registration ended")));
    channels_.erase(c);  // staging is freed once no transfer holds it
  }
  changed_.SignalAll();
}

void VersionCoordinator::OnParticipantAdded(const Participant& p) {
  if (p.role != Role::kDestination) return;
  absl::MutexLock lock(&mu_);
  // Its instance may be complete now, and behind: the delivery thread
  // bootstraps it from a donor if one holds the stream's latest version.
  deliveries_.AssertHeld();  // mu_ is its lock
  deliveries_.WantLocked(p.stream);
  changed_.SignalAll();
  offloads_.AssertHeld();  // mu_ is its lock
  offloads_.RankJoinedLocked(p);
  auto it = records_.find(p.instance_id);
  // A rank registered (again): what its memory holds is the client's word,
  // not ferryd's writing, so no patch goes there until a version commits.
  if (it != records_.end()) it->second.set_patch_base(0);
  // A clean abort left the instance whole on its committed version; once
  // its ranks register again (their node came back, say) it is a late
  // instance like any other, which a peer fills (donor_deliveries.h). A
  // dirty one waits for the next version: its memory is partly written.
  if (it != records_.end() && p.adapter == nullptr &&
      it->second.state() == v1::INSTANCE_STATE_ABORTED &&
      !it->second.dirty()) {
    it->second.set_state(v1::INSTANCE_STATE_IDLE);
    it->second.set_version(0);
    it->second.clear_abort_reason();
  }
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

}  // namespace ferry
