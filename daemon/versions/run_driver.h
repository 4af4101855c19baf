// RunDriver: the version state machine as the collaborators that run one
// kind of run see it (OffloadRuns, offload_runs.h; DonorDeliveries,
// donor_deliveries.h; AdapterRuns, adapter_runs.h). VersionCoordinator
// (version_coordinator.h) implements it; a collaborator drives its runs
// through these operations only: the busy rule, a run in the stream's
// delivery slot started and waited on, events sent, a run advanced,
// aborted or settled, and the records of streams and instances.
//
// Owner: VersionCoordinator, which hands itself to each collaborator.
// Threading: every method is called with the coordinator's lock held (the
// collaborator's lock: it is one). Clang cannot see through the interface;
// each method the coordinator implements is annotated, or asserts the lock,
// on its side (see transfer_queue.h for the pattern).
#ifndef FERRY_DAEMON_VERSIONS_RUN_DRIVER_H_
#define FERRY_DAEMON_VERSIONS_RUN_DRIVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/participant.h"
#include "daemon/versions/version_run.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

class RunDriver {
 public:
  virtual ~RunDriver() = default;

  // The one busy rule: why a new run cannot start now, or "" when it can.
  // For a stream (instance_id ""): ferryd is shutting down, or a run is in
  // progress on it ("version 4 is in progress on stream policy", "the
  // bootstrap of instance b from a is in progress on stream policy"). For
  // an instance (stream ""): it is offloaded, or, on any stream, a version
  // it takes part in has not settled it or a delivery writes or reads it.
  virtual std::string Busy(const std::string& stream,
                           const std::string& instance_id) const = 0;
  // Whether ferryd is shutting down (Shutdown began), and whether the
  // instance is offloaded (OffloadRuns).
  virtual bool ShuttingDown() const = 0;
  virtual bool Offloaded(const std::string& instance_id) const = 0;
  // Whether the delivery thread has yet to look at the stream for a
  // bootstrap, or looks at it now (DonorDeliveries::PendingLocked).
  virtual bool BootstrapPending(const std::string& stream) const = 0;
  // A run of `kind` for plan->instances[target] in the stream's delivery
  // slot, at `version`, reading `donor` ("" for none); its instance is
  // entered (NewInstanceRun) and nothing is sent yet.
  virtual std::shared_ptr<VersionRun> StartSlotRun(
      std::shared_ptr<const StreamPlan> plan, int32_t target, RunKind kind,
      int64_t version, const std::string& donor) = 0;
  // Waits (releasing the lock meanwhile) until the run's instance leaves
  // `phase` or the run settles; the phase's ack deadlines bound it.
  virtual void WaitWhile(const VersionRun& run, RunPhase phase) = 0;
  // Sends PREPARE to a new instance of `run`, or aborts it (a rank lost,
  // its plan's error, no staging).
  virtual void StartInstance(VersionRun& run, InstanceRun& inst) = 0;

  // Sends `kind` to every rank of the instance and waits for their acks;
  // `detail` (may be null) fills in each rank's event (OFFLOAD's and
  // ONLOAD's region ids).
  using EventDetail =
      std::function<void(const Participant&, v1::UpdateEvent*)>;
  virtual void Send(VersionRun& run, InstanceRun& inst,
                    v1::UpdateEventKind kind, const EventDetail& detail) = 0;
  // Every byte landed: APPLY to the instance's ranks.
  virtual void Apply(VersionRun& run, InstanceRun& inst) = 0;
  // The instance's phase or route changed: its status record follows.
  virtual void Record(const VersionRun& run, const InstanceRun& inst) = 0;
  virtual void Abort(VersionRun& run, InstanceRun& inst, AbortCause cause,
                     const std::string& reason) = 0;
  // Moves the run on as far as its acks allow, then settles it if it can.
  virtual void Advance(const std::shared_ptr<VersionRun>& run) = 0;
  // Settles the run if it can (no transfer in flight, its sources
  // committed or the run aborted, every instance settled), moving none.
  virtual void Settle(VersionRun& run) = 0;
  // The instance's status in the run, as the Versions RPCs report it.
  virtual v1::InstanceStatus Status(const VersionRun& run,
                                    const InstanceRun& inst) const = 0;

  // Reserves the staging of the instance's fallback tensors
  // (TransferQueue::ReserveStagingLocked), and queues a paused instance's
  // transfer, last.
  virtual absl::Status ReserveStaging(const VersionRun& run,
                                      const InstanceRun& inst) = 0;
  virtual void QueueTransfer(TransferTicket ticket) = 0;

  // The latest status of an instance that took part in a run: null when
  // none (Find...), or created empty (...Of).
  virtual const v1::InstanceStatus* FindRecord(
      const std::string& id) const = 0;
  virtual v1::InstanceStatus& RecordOf(const std::string& id) = 0;
  // What a stream keeps of its runs: null when it never had one (Find...),
  // or created empty (...Of).
  virtual const StreamState* FindStream(const std::string& stream) const = 0;
  virtual StreamState& StreamOf(const std::string& stream) = 0;

  // A donor for `target` at `version` (DonorDeliveries::ChooseDonorLocked).
  virtual int32_t ChooseDonor(const StreamPlan& sp, int32_t target,
                              int64_t version, std::string* why) const = 0;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_RUN_DRIVER_H_
