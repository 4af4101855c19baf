// OffloadRuns: Lifecycle.Offload and Onload (docs/api.md), the two run
// kinds that take an instance's memory away and give it back, and the
// offloaded instances in between (their host copies, the ranks still
// registered). offloads.cc: the offload, the host copy, the members'
// memory (Peer.ManageMemory, member_memory.h), what an offloaded instance
// keeps; onloads.cc: the onload and its refill (the host copy, else a
// donor instance, else the stream's next version), and which ranks may
// register new regions meanwhile (RegionsFixed).
//
// Both are one-instance runs of the version state machine in the stream's
// delivery slot (version_run.h), driven by the Lifecycle call's thread
// between the phases the ranks' acks move, through RunDriver
// (run_driver.h), which the coordinator implements.
//
// Owner: VersionCoordinator (version_coordinator.h), which tells it when an
// offload's ranks all acked and when a rank of an offloaded instance leaves
// or joins; callers reach it as its offloads() (the Lifecycle and
// Inspection services, the Server, adapters.cc). Threading: no lock of its own. It
// runs under the coordinator's (`mu`, given at construction), as the
// TransferQueue does (transfer_queue.h): the coordinator says so with
// AssertHeld before each ...Locked call. The Lifecycle calls take the lock
// and release it while copying and while calling members.
#ifndef FERRY_DAEMON_VERSIONS_OFFLOAD_RUNS_H_
#define FERRY_DAEMON_VERSIONS_OFFLOAD_RUNS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/memory/host_copy.h"
#include "daemon/memory/member_memory.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/participant.h"
#include "daemon/versions/run_driver.h"
#include "daemon/versions/version_run.h"
#include "proto/ferry/v1/peer.pb.h"
#include "proto/ferry/v1/version.pb.h"
#include "transport/device_memory.h"

namespace ferry {

class OffloadRuns {
 public:
  using Expired = std::function<bool()>;

  // `mu` and `changed` are the coordinator's lock and CondVar, `driver`
  // the coordinator; all outlive this. `plans` and `devices`
  // (VersionCoordinatorOptions::devices, may be null) are not owned.
  OffloadRuns(absl::Mutex& mu, absl::CondVar& changed, RunDriver* driver,
              PlanCache* plans, DeviceMemory* devices);
  OffloadRuns(const OffloadRuns&) = delete;
  OffloadRuns& operator=(const OffloadRuns&) = delete;

  // Offload and onload of ranks on members' nodes go through this
  // (Peer.ManageMemory, member_memory.h; set before the coordinator
  // starts). Unset: such an offload is UNIMPLEMENTED.
  void set_remote_memory(ManageRemoteMemory remote_memory) {
    remote_memory_ = std::move(remote_memory);
  }
  // Tells clang that the caller's lock is this one's (they are one).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(mu_) {
    mu_.AssertHeld();
  }

  // Lifecycle.Offload: pauses the instance, copies its regions into this
  // process's memory if `keep_host_copy`, has its ranks release their
  // memory, releases the daemon's maps of it, and returns its status:
  // OFFLOADED, or ABORTED (with dirty = true only when some rank may have
  // released its memory). NOT_FOUND: no complete instance on `stream`;
  // FAILED_PRECONDITION: already offloaded, or a version or delivery in
  // progress (named); RESOURCE_EXHAUSTED: the host copy would not fit in
  // the memory the kernel reports available (here, or on a member that
  // maps some of the ranks: their copies are kept there).
  absl::StatusOr<v1::InstanceStatus> Offload(const std::string& stream,
                                             const std::string& instance_id,
                                             bool keep_host_copy,
                                             const Expired& expired)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Lifecycle.Onload: ONLOAD to every rank, then the refill described
  // above. Returns COMMITTED, or ABORTED with dirty = true (the reason says
  // why: no copy of the latest version, a rank lost, ...). NOT_FOUND: not
  // every rank registered; FAILED_PRECONDITION: not offloaded, or a version
  // or delivery in progress.
  absl::StatusOr<v1::InstanceStatus> Onload(const std::string& stream,
                                            const std::string& instance_id,
                                            const Expired& expired)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Registry.UpdateRegions: "" when `p`'s regions may be replaced now (its
  // instance is offloaded, or its ONLOAD awaits the rank's ack), else why
  // not.
  std::string RegionsFixed(const Participant& p) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // An offloaded instance's host copy (Inspection): bytes and the version
  // it holds; bytes 0 when the instance is not offloaded or kept none.
  struct HostCopyInfo {
    int64_t bytes = 0;
    int64_t version = 0;
  };
  HostCopyInfo HostCopyOf(const std::string& instance_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // Whether the instance is offloaded.
  bool IsOffloaded(const std::string& instance_id) const
      ABSL_LOCKS_EXCLUDED(mu_);

  // REQUIRES: mu_ held, for every *Locked method.
  bool IsOffloadedLocked(const std::string& instance_id) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Every rank acked OFFLOAD (the state machine, run_state_machine.cc):
  // the instance is offloaded and the daemon's maps of its memory are
  // released.
  void FinishOffloadLocked(const VersionRun& run, const InstanceRun& inst)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A destination rank of an offloaded instance left: true when it was
  // the last, and the instance, with its host copy, is dropped.
  bool RankLeftLocked(const Participant& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A rank of an offloaded instance registered (again).
  void RankJoinedLocked(const Participant& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

 private:
  // An offloaded instance: its stream, its host copy and the ids of its
  // ranks still registered.
  struct OffloadedInstance {
    std::string stream;
    KeptCopy copy;
    std::set<std::string> rank_ids;
  };

  // Peer.ManageMemory of `action` for every member in `members`, without
  // the lock; the bytes copied, or the first error.
  absl::StatusOr<int64_t> ManageMembers(
      const std::map<std::string, std::vector<std::string>>& members,
      v1::MemoryAction action, int64_t version) ABSL_LOCKS_EXCLUDED(mu_);
  // The same once a run settled, for what needs no answer (RELEASE, DROP):
  // releases mu_ meanwhile; a failure is logged (`what` names the call).
  void TellMembersLocked(
      const std::map<std::string, std::vector<std::string>>& members,
      v1::MemoryAction action, const std::string& what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Offload's host copy of the paused instance, without the lock: `local`
  // here, `members` on their nodes; kept in run.copy, or the instance
  // aborts (clean: only read).
  void TakeHostCopyLocked(
      VersionRun& run, const std::vector<HostCopy::Rank>& local,
      const std::map<std::string, std::vector<std::string>>& members,
      int64_t bytes) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The onload's refill once every rank allocated again.
  void RefillOnloadLocked(const std::shared_ptr<VersionRun>& run)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Its two ways: the instance's host copy (it holds the latest version;
  // `now` is the plan of the ranks' new memory), else a donor instance that
  // holds `latest` (else the instance aborts, dirty, for the next version).
  void RestoreHostCopyLocked(const std::shared_ptr<VersionRun>& run,
                             std::shared_ptr<const StreamPlan> now,
                             int32_t target) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RefillFromPeerLocked(const std::shared_ptr<VersionRun>& run,
                            const std::shared_ptr<const StreamPlan>& now,
                            int32_t target, int64_t latest)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  absl::Mutex& mu_;          // the coordinator's
  absl::CondVar& changed_;   // the coordinator's
  RunDriver* const driver_;  // the coordinator
  PlanCache* const plans_;
  DeviceMemory* const devices_;
  // Set before the coordinator starts; read without the lock.
  ManageRemoteMemory remote_memory_;
  // Offloaded instances, by id; dropped when the last of their ranks
  // leaves, or when their onload begins.
  std::map<std::string, OffloadedInstance> offloaded_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_OFFLOAD_RUNS_H_
