// TransferQueue: the transfer half of a run (VersionCoordinator,
// version_coordinator.h). It holds the instances that paused and wait for
// their transfer (TransferTicket, version_run.h), the transfer workers that
// run them, the staging reservation for an instance's fallback tensors
// under ferryd's staging limit, and the memory each job reads and writes.
//
// Order: each worker takes the first ticket that need not wait. A replica
// that relays waits for the replica it relays from while that one is about
// to land (so that the trainer sends each byte once); an exchange's second
// part waits for its partner's first; independent instances run at once.
// A relay or exchange read that fails under it (the other replica's node
// died) is queued again, first, to read the sources instead.
//
// Owner: VersionCoordinator, which drives it through PushLocked and
// ReserveStagingLocked and is driven back through Runs (what a landed or
// failed transfer does to its run: record, APPLY, abort, advance).
// Threading: the queue has no lock of its own. It runs under the
// coordinator's (`mu`, given at construction): its tickets and the runs
// they name are one state, and a worker holds that lock except while its
// executor copies. Clang cannot tell that the coordinator's mu_ and this
// queue's mu_ are one lock; the coordinator says so with AssertHeld before
// each call, and each Runs method it implements asserts it in turn.
#ifndef FERRY_DAEMON_VERSIONS_TRANSFER_QUEUE_H_
#define FERRY_DAEMON_VERSIONS_TRANSFER_QUEUE_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/memory/staging_area.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/transfer/local_executor.h"
#include "daemon/transfer/transfer_checksums.h"
#include "daemon/transfer/transfer_job.h"
#include "daemon/versions/version_run.h"

namespace ferry {

class TransferQueue {
 public:
  // The coordinator as the queue sees it. Every method is called with the
  // queue's lock (the coordinator's) held, on a transfer worker or inside
  // a ...Locked call of the queue.
  class Runs {
   public:
    virtual ~Runs() = default;
    // The staging of `rank`'s event channel, made with the channel.
    virtual StagingArea& StagingOf(const Participant& rank) = 0;
    // The staging of the channel keyed `participant_id`; null when the rank
    // has none (it never subscribed, or left).
    virtual std::shared_ptr<StagingArea> FindStaging(
        const std::string& participant_id) = 0;
    // Staging reserved now, every rank together.
    virtual int64_t StagingReserved() const = 0;
    // The instance's phase or route changed: its status record follows.
    virtual void Record(const VersionRun& run, const InstanceRun& inst) = 0;
    virtual void Abort(VersionRun& run, InstanceRun& inst, AbortCause cause,
                       const std::string& reason) = 0;
    // Every byte landed: APPLY to the instance's ranks.
    virtual void Apply(VersionRun& run, InstanceRun& inst) = 0;
    // Moves the run on as far as its acks allow (and settles it).
    virtual void Advance(const std::shared_ptr<VersionRun>& run) = 0;
  };

  struct Options {
    std::string node;               // VersionCoordinator::Options::node
    absl::Duration relay_wait;      // ... ::relay_wait
    int workers = 1;                // ... ::transfer_workers
    int64_t max_staging_bytes = -1;  // ... ::max_staging_bytes
  };

  // `mu` and `changed` are the coordinator's lock and CondVar; `runs` the
  // coordinator; all outlive the queue. `executor` is not owned.
  TransferQueue(const Options& options, absl::Mutex& mu,
                absl::CondVar& changed, Runs* runs, LocalExecutor* executor);
  ~TransferQueue();
  TransferQueue(const TransferQueue&) = delete;
  TransferQueue& operator=(const TransferQueue&) = delete;

  // Starts the workers. `remote` copies instances whose ranks are on
  // another node, `checksums` hashes every delivery's sources; either may
  // be null (one node; no checksums). Not owned.
  void Start(RemoteExecutor* remote, TransferChecksums* checksums);
  // The workers exit at their next wake (the coordinator signals).
  void StopLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Joins the workers; after StopLocked, without the lock.
  void Join() ABSL_LOCKS_EXCLUDED(mu_);
  // Tells clang that the caller's lock is this queue's (they are one).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(mu_) {
    mu_.AssertHeld();
  }

  // Queues a paused instance's transfer, last.
  void PushLocked(TransferTicket ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Reserves the staging of the instance's fallback tensors on this node:
  // RESOURCE_EXHAUSTED (naming the instance and the bytes) when all
  // staging together would pass the limit or /dev/shm lacks the room.
  absl::Status ReserveStagingLocked(const VersionRun& run,
                                    const InstanceRun& inst)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The staging limit in force (Options::max_staging_bytes, resolved:
  // negative is half the size of /dev/shm, measured here).
  int64_t max_staging_bytes() const { return max_staging_bytes_; }

 private:
  // One ticket's transfer as a worker runs it.
  struct Flight {
    TransferTicket ticket;
    TransferJob job;
    bool remote = false;  // the RemoteExecutor copies it
    std::shared_ptr<const InstanceChecksums> relayed_sums;
    std::shared_ptr<TransferProgress> progress;  // kept alive meanwhile
    std::vector<v1::ApplyDetail> remote_apply;   // job.apply points here
    absl::Status status;
    std::shared_ptr<const InstanceChecksums> sums;
    absl::Duration took;
  };

  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for the first ticket that need not wait and takes it; false
  // once the queue stops.
  bool NextLocked(TransferTicket* ticket) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the ticket's instance relays from a replica that is paused or
  // transferring in this version, or still pausing and the ticket is
  // younger than relay_wait (then it waits for it to land).
  bool WaitsForRelayLocked(const TransferTicket& t) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the ticket is an exchange's second part whose partner has not
  // landed its first part yet but is transferring or about to (as above).
  bool WaitsForPartnerLocked(const TransferTicket& t) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The run's entry for the partner the instance exchanges with; null
  // when it has no exchange or the partner takes no part in the run.
  const InstanceRun* PartnerLocked(const VersionRun& run,
                                   const InstanceRun& inst) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RankMemory MemoryOfLocked(const StreamPlan& plan, int32_t planned,
                            size_t tp_rank) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The job for the flight's ticket (its route: relay, exchange part,
  // remote), and the instance into TRANSFER.
  void PrepareLocked(Flight& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs the job's executor and hashes its sources, without the lock.
  void ExecuteLocked(Flight& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // What the outcome does to the instance, then moves the run on.
  void FinishLocked(Flight& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A relay or exchange read failed under it: the same bytes from the
  // sources, first in the queue.
  void RetryFromSourcesLocked(Flight& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An exchange's first part landed: its second part queues, first.
  void FirstPartLandedLocked(Flight& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The whole transfer ended: APPLY, or the instance aborts.
  void TransferEndedLocked(Flight& f) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  int64_t max_staging_bytes_ = 0;  // options_.max_staging_bytes, resolved
  absl::Mutex& mu_;                // the coordinator's
  absl::CondVar& changed_;         // the coordinator's
  Runs* const runs_;
  LocalExecutor* const executor_;
  // Set by Start, before the workers run; read by them without the lock.
  RemoteExecutor* remote_ = nullptr;
  TransferChecksums* checksums_ = nullptr;

  std::deque<TransferTicket> tickets_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> workers_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_TRANSFER_QUEUE_H_
