// VersionCoordinator: the version protocol of docs/api.md ("Version
// protocol") and design §5, for every stream this daemon coordinates.
//
// Per stream one version at a time. Per instance taking part, a state
// machine: PREPARE, PAUSE, PAUSED, TRANSFER, APPLY, then COMMITTED or
// ABORTED (version_run.h lists the phases and the records of a run).
//
// Instances are independent: each has its own acks, deadlines and
// transfer, so one failing never blocks another (a replica that would have
// relayed from a failed one is fed from the sources instead). Every run
// settles: each event has an ack timeout, and the version timeout counts
// from the first CommitVersion (then unsettled instances abort, and
// missing source commits abort the whole version). Before the first
// commit a version waits for its sources without a deadline: a trainer
// step may be long, and a source that dies loses its lease.
//
// Owner: the Server. Threading: one absl::Mutex (mu_) guards all protocol
// state, with one CondVar signalled on every change. gRPC handler threads
// call the public methods, and none waits for a version: CommitVersion is
// answered by a callback when its run settles, Subscribe streams are woken
// through their EventSink (event_sink.h). Threads of its own: the transfer
// workers (transfer_queue.h: each runs the next instance that paused,
// without the lock), the deadline thread and the delivery thread
// (bootstraps, donor_deliveries.h). It never calls the Registry or the
// PlanCache while holding mu_.
//
// Besides versions, the same state machine runs donor deliveries
// (bootstrap, ReloadInPlace), offloads, onloads and adapter unloads, one at
// a time per stream in its delivery slot (version_run.h); each kind is a
// collaborator that shares mu_ and drives its runs through RunDriver.
//
// Files, one concept each: version_coordinator.cc (lifecycle, Versions
// RPCs), run_state_machine.cc, rank_event_channel.cc (events,
// subscriptions, Ack), version_deadlines.cc, participant_changes.cc,
// instance_state.cc (busy, records), version_progress.cc (inspection,
// metrics); collaborators: transfer_queue.h, offload_runs.h (offloads.cc,
// onloads.cc), donor_deliveries.h, adapter_runs.h; run_driver.h.
#ifndef FERRY_DAEMON_VERSIONS_VERSION_COORDINATOR_H_
#define FERRY_DAEMON_VERSIONS_VERSION_COORDINATOR_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "common/clock.h"
#include "daemon/memory/staging_area.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/registry.h"
#include "daemon/transfer/local_executor.h"
#include "daemon/transfer/transfer_checksums.h"
#include "daemon/versions/adapter_runs.h"
#include "daemon/versions/coordinator_options.h"
#include "daemon/versions/donor_deliveries.h"
#include "daemon/versions/event_sink.h"
#include "daemon/versions/offload_runs.h"
#include "daemon/versions/run_driver.h"
#include "daemon/versions/transfer_queue.h"
#include "daemon/versions/version_run.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

class VersionCoordinator : public Registry::Listener,
                           public EventOutboxes,
                           private TransferQueue::Runs,
                           private RunDriver {
 public:
  // The coordinator's settings (coordinator_options.h).
  using Options = VersionCoordinatorOptions;

  VersionCoordinator(const Options& options, PlanCache* plans,
                     LocalExecutor* executor);
  ~VersionCoordinator() override;
  VersionCoordinator(const VersionCoordinator&) = delete;
  VersionCoordinator& operator=(const VersionCoordinator&) = delete;

  // Collaborators, not owned, set before Start (null: none): `remote` takes
  // instances with ranks on another node, `checksums` hashes deliveries'
  // sources, `metrics` counts runs, outcomes, phases and bytes.
  void set_remote_executor(RemoteExecutor* remote) { remote_ = remote; }
  void set_checksums(TransferChecksums* checksums) { checksums_ = checksums; }
  void set_metrics(DaemonMetrics* metrics) { metrics_ = metrics; }
  // Staging reserved for fallback tensors now, all instances together.
  int64_t StagingBytesInUse() const ABSL_LOCKS_EXCLUDED(mu_);

  // Starts the threads, after removing staging segments dead ferryds left.
  void Start();
  // The staging limit in force (Options::max_staging_bytes, resolved).
  int64_t max_staging_bytes() const { return transfers_.max_staging_bytes(); }
  // Refuses new versions (UNAVAILABLE), lets those in flight settle for up
  // to `drain`, aborts the rest, ends Subscribe streams, joins. Idempotent.
  void Shutdown(absl::Duration drain) ABSL_LOCKS_EXCLUDED(mu_);

  // Versions RPCs; `source` / `destination` are authenticated participants.
  // `expired` (may be empty): the caller's deadline passed or it cancelled;
  // BeginVersion then starts nothing (DEADLINE_EXCEEDED, after planning).
  using Expired = std::function<bool()>;
  absl::StatusOr<std::vector<std::string>> BeginVersion(
      const std::shared_ptr<const Participant>& source, int64_t version,
      const Expired& expired = nullptr) ABSL_LOCKS_EXCLUDED(mu_);
  // Counts `source`'s commit and answers `done` once with the version's
  // outcome (ABORTED when the whole version was) or why it was refused.
  // No thread waits: `done` runs with mu_ held on the thread that settles
  // the run (or this one); it must not block or call the coordinator.
  using CommitDone = std::function<void(const VersionRun::Outcome&)>;
  void CommitVersion(const Participant& source, int64_t version,
                     CommitDone done) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<v1::InstanceStatus>> AbortVersion(
      const Participant& source, int64_t version, const std::string& reason)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Ack(const Participant& destination, const v1::AckRequest& ack)
      ABSL_LOCKS_EXCLUDED(mu_);
  // EventOutboxes (event_sink.h): the ranks' Subscribe streams.
  absl::StatusOr<uint64_t> OpenSubscription(
      const std::shared_ptr<const Participant>& destination,
      EventSink* sink) override ABSL_LOCKS_EXCLUDED(mu_);
  std::optional<v1::UpdateEvent> NextEvent(const std::string& channel_id,
                                           uint64_t generation) override
      ABSL_LOCKS_EXCLUDED(mu_);
  void CloseSubscription(const std::string& channel_id, uint64_t generation,
                         std::vector<v1::UpdateEvent> unsent) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<v1::InstanceStatus>> WaitForVersion(
      const std::string& stream, int64_t version,
      const std::string& instance_id, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The run kinds of their own, documented in their headers: Offload,
  // Onload, RegionsFixed, HostCopyOf, IsOffloaded (offload_runs.h),
  // ReloadInPlace (donor_deliveries.h), WaitForFill, UnloadAdapter
  // (adapter_runs.h).
  OffloadRuns& offloads() { return offloads_; }
  const OffloadRuns& offloads() const { return offloads_; }
  DonorDeliveries& deliveries() { return deliveries_; }
  AdapterRuns& adapters() { return adapters_; }
  // Drops the record of an instance gone for good (an adapter detached).
  void ForgetInstance(const std::string& instance_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Lifecycle.SwapModel. What keeps the instance from switching now
  // ("version 4 is in progress on stream policy", a delivery), or "".
  std::string InstanceBusy(const std::string& instance_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The instance follows `stream` under a new registration: IDLE at its new
  // held_version, and it may be bootstrapped on the new stream.
  void InstanceSwapped(const std::string& instance_id,
                       const std::string& stream) ABSL_LOCKS_EXCLUDED(mu_);

  // Inspection.
  StreamSummary Summary(const std::string& stream) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The instance's status on its latest version, or IDLE at held_version.
  v1::InstanceStatus InstanceStatusOf(const std::string& instance_id,
                                      int64_t held_version) const
      ABSL_LOCKS_EXCLUDED(mu_);
  bool IsSubscribed(const std::string& participant_id) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // NOT_FOUND for a stream without versions or a version without record.
  absl::StatusOr<v1::GetProgressResponse> Progress(const std::string& stream,
                                                   int64_t version) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // The version in progress and the settled history (Options::history),
  // newest first. NOT_FOUND for a stream without versions.
  absl::StatusOr<std::vector<v1::GetProgressResponse>> History(
      const std::string& stream) const ABSL_LOCKS_EXCLUDED(mu_);

  void OnParticipantRemoved(const Participant& participant,
                            const std::string& why) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // A rank that holds less than its instance's committed_version (a
  // restarted rank, with the base weights) lowers it: the instance is
  // listed IDLE (or still ABORTED) at the rank's held_version.
  void OnParticipantAdded(const Participant& participant) override
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // REQUIRES: mu_ held, for every *Locked method and every override of
  // TransferQueue::Runs and RunDriver (documented there). Clang cannot
  // check calls through those: each asserts it, or is annotated for here.
  StagingArea& StagingOf(const Participant& rank) override;
  std::shared_ptr<StagingArea> FindStaging(
      const std::string& participant_id) override;
  int64_t StagingReserved() const override;
  void Record(const VersionRun& run, const InstanceRun& inst) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Abort(VersionRun& run, InstanceRun& inst, AbortCause cause,
             const std::string& reason) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Apply(VersionRun& run, InstanceRun& inst) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Advance(const std::shared_ptr<VersionRun>& run) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Advance for instance `i` alone (its rank's ack moved nothing else).
  void AdvanceOne(const std::shared_ptr<VersionRun>& run, size_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AdvanceInstance(const std::shared_ptr<VersionRun>& run, size_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // CommitVersion's refusals; the kept answers, the outcome computed once.
  absl::Status CountCommit(const Participant& source, int64_t version,
                           CommitDone& done) ABSL_LOCKS_EXCLUDED(mu_);
  void AnswerCommitsLocked(VersionRun& run) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string Busy(const std::string& stream,
                   const std::string& instance_id) const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  bool ShuttingDown() const override;
  bool Offloaded(const std::string& instance_id) const override;
  bool BootstrapPending(const std::string& stream) const override;
  std::shared_ptr<VersionRun> StartSlotRun(
      std::shared_ptr<const StreamPlan> plan, int32_t target, RunKind kind,
      int64_t version, const std::string& donor) override;
  void WaitWhile(const VersionRun& run, RunPhase phase) override;
  void StartInstance(VersionRun& run, InstanceRun& inst) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Send(VersionRun& run, InstanceRun& inst, v1::UpdateEventKind kind,
            const EventDetail& detail) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Settle(VersionRun& run) override ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::InstanceStatus Status(const VersionRun& run,
                            const InstanceRun& inst) const override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ReserveStaging(const VersionRun& run,
                              const InstanceRun& inst) override;
  void QueueTransfer(TransferTicket ticket) override;
  const v1::InstanceStatus* FindRecord(const std::string& id) const override;
  v1::InstanceStatus& RecordOf(const std::string& id) override;
  const StreamState* FindStream(const std::string& stream) const override;
  StreamState& StreamOf(const std::string& stream) override;
  int32_t ChooseDonor(const StreamPlan& sp, int32_t target, int64_t version,
                      std::string* why) const override;
  // A run's entry for sp.instances[i]; creates the instance's record (IDLE
  // at its ranks' lowest held version) if it never took part.
  InstanceRun NewInstanceRunLocked(const StreamPlan& sp, size_t i)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  RankChannel& ChannelLocked(const Participant& p)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Ends the channel's live Subscribe stream, if any, with `why`.
  void EndSubscriptionLocked(RankChannel& c, const absl::Status& why)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void PostLocked(VersionRun& run, InstanceRun& inst, size_t tp_rank,
                  v1::UpdateEvent event, bool needs_ack)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortRunLocked(VersionRun& run, AbortCause cause,
                      const std::string& reason)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::GetProgressResponse ProgressLocked(const VersionRun& run) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Tells the metrics (if any) how a settled run and its instances went.
  void ReportSettledLocked(const VersionRun& run) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<v1::InstanceStatus> OutcomeLocked(const VersionRun& run) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::shared_ptr<VersionRun> FindRunLocked(const std::string& stream,
                                            int64_t version) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The run (version or donor delivery) with this serial, if still kept.
  std::shared_ptr<VersionRun> FindRunBySerialLocked(const std::string& stream,
                                                    uint64_t serial) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void CheckDeadlinesLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  void DeadlineLoop() ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  const Clock* const clock_;  // options_.clock, or the real one
  PlanCache* const plans_;
  RemoteExecutor* remote_ = nullptr;
  TransferChecksums* checksums_ = nullptr;
  DaemonMetrics* metrics_ = nullptr;

  mutable absl::Mutex mu_;
  absl::CondVar changed_;  // signalled on every state change
  // The collaborators (their headers say what each holds), under mu_.
  TransferQueue transfers_;
  OffloadRuns offloads_;
  DonorDeliveries deliveries_;
  AdapterRuns adapters_;
  std::map<std::string, StreamState> streams_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, RankChannel> channels_ ABSL_GUARDED_BY(mu_);
  // Latest status of every instance that took part in a version.
  std::map<std::string, v1::InstanceStatus> records_ ABSL_GUARDED_BY(mu_);
  uint64_t next_run_serial_ ABSL_GUARDED_BY(mu_) = 1;
  bool shutting_down_ ABSL_GUARDED_BY(mu_) = false;  // refuse new versions
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;       // threads exit
  bool started_ = false;
  std::thread deadline_thread_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_VERSION_COORDINATOR_H_
