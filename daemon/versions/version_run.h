// The records VersionCoordinator (version_coordinator.h) keeps: a run (a
// version, a donor delivery, an offload, an onload or an adapter's unload),
// its instances and the phase each is in, what a stream keeps of its runs,
// an offloaded instance's host copy, and each destination rank's event
// channel.
//
// Every run kind goes through one state machine, per instance (RunPhase):
//
//   PREPARE   BeginVersion: PREPARE sent to every rank; waiting for acks.
//             Staging for fallback tensors is reserved here.
//   PAUSE     every rank acked PREPARE and every source rank committed:
//             PAUSE sent; waiting for each rank's ack at its safe point.
//             (Reported as INSTANCE_STATE_PREPARE until every rank paused.)
//   PAUSED    every rank paused; queued for the transfer worker.
//   TRANSFER  the LocalExecutor is writing live buffers and staging.
//   APPLY     transfer done: APPLY (fallback tensors, staging regions) sent;
//             waiting for every rank to ack that it holds all of v.
//   COMMITTED every rank acked APPLY: COMMIT sent; committed_version = v.
//   ABORTED   anything failed (a late or FAILED ack, a rank or source lost,
//             a planning error, staging, the transfer, the version
//             timeout): ABORT(reason, dirty) sent. dirty = live buffers may
//             be partly written (the transfer had started, or the instance
//             was already dirty); a dirty instance keeps dirty = true in its
//             status until a later version commits on it.
//   OFFLOAD, OFFLOADED, ONLOAD, UNLOAD: the lifecycle runs' own waits
//             (offloads.cc, adapter_runs.cc), below.
//
// Donor deliveries (donor_deliveries.cc): an instance that is behind the
// stream's latest committed version L (a late instance, bootstrapped as
// soon as all its ranks registered) or that asks for L again
// (ReloadInPlace) is filled from a donor instance that holds L, never from
// the trainer. Such a delivery is a run of the same state machine with one
// instance, the donor's ranks as its sources (donor_plan.h) and no source
// commits to wait for; it goes through PREPARE, PAUSE, APPLY and COMMIT at
// version L. One delivery or version at a time per stream: a BeginVersion
// that arrives during a delivery waits for it to settle (the donor is not
// overwritten while it is read), and a delivery starts only between
// versions. A third thread, the delivery thread, starts bootstraps.
//
// Offload and onload (OffloadRuns, offload_runs.h) are runs of the same state
// machine with one instance and no sources, in the stream's delivery slot
// (one at a time, never during a version). Offload: PAUSE, the host copy
// if asked (host_copy.h), then OFFLOAD; the instance is then OFFLOADED:
// every version lists it and settles it at once as OFFLOADED, no donor
// reads it, and its ranks' memory maps are released. Onload: ONLOAD (each
// rank allocates again and calls Registry.UpdateRegions), then it is
// filled from the host copy if that holds the stream's latest committed
// version (APPLY, COMMIT), else from a donor instance that holds it (a
// donor delivery's transfer, APPLY, COMMIT), else it is left ABORTED and
// dirty for the stream's next version.
//
// Owner: VersionCoordinator. Threading: plain data; every field of a run
// that is kept in the coordinator is guarded by its lock (clang cannot see
// inside these structs: docs/architecture.md, "Locking").
#ifndef FERRY_DAEMON_VERSIONS_VERSION_RUN_H_
#define FERRY_DAEMON_VERSIONS_VERSION_RUN_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/memory/host_copy.h"
#include "daemon/memory/staging_area.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/participant.h"
#include "daemon/transfer/transfer_checksums.h"
#include "daemon/transfer/transfer_job.h"
#include "daemon/versions/event_sink.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

enum class RunPhase {
  kPrepare,
  kPause,
  kPaused,
  kTransfer,
  kApply,
  kCommitted,
  kAborted,
  kOffload,    // OFFLOAD sent; waiting for every rank to release
  kOffloaded,  // settled: the ranks released their memory
  kOnload,     // ONLOAD sent; waiting for every rank to allocate again
  kUnload,     // UNLOAD_ADAPTER sent; waiting for every rank to drop it
};

struct InstanceRun {
  std::string id;
  int32_t planned = -1;  // index into the run's plan->instances
  std::vector<std::shared_ptr<const Participant>> ranks;  // by tp rank
  RunPhase phase = RunPhase::kPrepare;
  v1::UpdateEventKind waiting_kind = v1::UPDATE_EVENT_KIND_UNSPECIFIED;
  std::vector<uint64_t> waiting_event;  // by tp rank; 0: acked
  absl::Time ack_deadline = absl::InfiniteFuture();
  bool was_dirty = false;  // dirty before this version began
  bool dirty = false;
  // Its record's patch_base when the run began: the version its ranks
  // hold exactly as ferryd wrote them (0: none; delta versions).
  int64_t delta_base = 0;
  bool transfer_clean = false;  // every byte of v landed
  std::string relayed_from;     // the replica its transfer copied from
  // A read of another replica failed (its relay, or its exchange's
  // second part: the replica's node died mid-copy, say): the rest of its
  // bytes come from the sources, once.
  bool replica_failed = false;
  // Its exchange (core/exchange.h): the first part landed (it holds
  // what its partner is given by it); the partner that gave the second
  // part ("" while none did); what the first part moved, its checksums
  // and APPLY details, kept for the second.
  bool first_part_landed = false;
  std::string given_by;
  int64_t first_part_bytes = 0;
  std::shared_ptr<const InstanceChecksums> first_part_sums;
  std::vector<v1::ApplyDetail> first_part_apply;
  std::string abort_reason;
  AbortCause abort_cause = AbortCause::kRankFailed;
  // When its phases began and ended, for the metrics' phase durations.
  absl::Time pause_sent_at = absl::InfiniteFuture();
  absl::Time paused_at = absl::InfiniteFuture();
  absl::Time transfer_started_at = absl::InfiniteFuture();
  absl::Time transfer_done_at = absl::InfiniteFuture();
  absl::Time committed_at = absl::InfiniteFuture();
  bool remote_transfer = false;  // copied by the RemoteExecutor
  std::shared_ptr<TransferProgress> progress;
  // By tp rank, when the instance's staging is on a member's node.
  std::vector<v1::ApplyDetail> remote_apply;
  // The checksums of this delivery (transfer_checksums.h), once landed.
  std::shared_ptr<const InstanceChecksums> checksums;
  bool settled() const {
    return phase == RunPhase::kCommitted || phase == RunPhase::kAborted ||
           phase == RunPhase::kOffloaded;
  }
};

// What a run delivers: a version from the sources (kVersion), the latest
// committed version from a donor instance (kBootstrap, kReload:
// donor_deliveries.cc), an offload or onload (offloads.cc), or an adapter's
// unload (adapter_runs.cc).
enum class RunKind {
  kVersion,
  kBootstrap,
  kReload,
  kOffload,
  kOnload,
  kUnloadAdapter,
};

// An offloaded instance's host copy: of its ranks on this node here, of
// those on members' nodes on those members (member_memory.h).
struct KeptCopy {
  bool kept = false;
  int64_t version = 0;
  int64_t bytes = 0;  // all of it, here and on members
  std::shared_ptr<const HostCopy> local;  // null: no rank here
  std::map<std::string, std::vector<std::string>> members;  // node -> ids
};

// "bootstrap", "reload", "offload", "onload", "unload_adapter" or
// "version": how logs, metrics and PeerDelivery.kind name a run kind.
const char* RunKindName(RunKind kind);

// A rank as the host copy of an offload or onload knows it (host_copy.h).
HostCopy::Rank HostCopyRank(const Participant& p);

struct VersionRun {
  uint64_t serial = 0;
  RunKind kind = RunKind::kVersion;
  std::string donor;  // donor deliveries: the instance read from
  std::string stream;
  int64_t version = 0;
  std::shared_ptr<const StreamPlan> plan;
  int32_t world_size = 0;
  std::set<int32_t> begun;
  std::set<int32_t> committed;
  absl::Time begun_at;
  absl::Time deadline = absl::InfiniteFuture();  // from the first commit
  absl::Time first_byte_at = absl::InfiniteFuture();
  absl::Time settled_at = absl::InfiniteFuture();
  std::vector<InstanceRun> instances;  // sorted by id
  // An onload refilled from the host copy: the bytes are those the
  // instance's checksums were taken of, so they stay.
  bool from_host_copy = false;
  // Offload: the copy taken; onload: the copy to restore.
  KeptCopy copy;
  bool aborted = false;  // the whole version (AbortVersion, source lost)
  std::string abort_reason;
  bool settled = false;
  // The answers to the trainer ranks' CommitVersion calls, each called
  // once with the version's outcome when the run settles (or ferryd
  // stops), with the coordinator's lock held. Callbacks, not waiting
  // threads: a fleet's 256 trainer ranks commit at once, and each waiting
  // thread woke on every one of the version's 3,072 acks.
  using Outcome = absl::StatusOr<std::vector<v1::InstanceStatus>>;
  std::vector<std::function<void(const Outcome&)>> on_settled;
  int transfers_in_flight = 0;
  bool all_committed() const {
    return static_cast<int32_t>(committed.size()) == world_size;
  }
};

// Per-stream numbers for ListStreams (VersionCoordinator::Summary).
struct StreamSummary {
  int64_t latest_committed = 0;
  int64_t in_progress = 0;
  // The stream's donor delivery in progress, else its latest; unset
  // (empty instance_id) when it never had one.
  v1::PeerDelivery delivery;
};

struct StreamState {
  int64_t last_begun = 0;
  int64_t latest_committed = 0;
  std::shared_ptr<VersionRun> current;
  std::deque<std::shared_ptr<VersionRun>> history;  // settled, oldest first
  // The donor delivery in progress (bootstrap or reload), else null; and
  // the latest settled one, for inspection.
  std::shared_ptr<VersionRun> delivery;
  std::shared_ptr<VersionRun> last_delivery;
  // Instance -> the (version, membership epoch) of its last bootstrap
  // attempt: a bootstrap that aborted is not retried until one changes.
  std::map<std::string, std::pair<int64_t, uint64_t>> bootstrap_tried;
};

// An instance of a run waiting for a transfer worker (transfer_queue.h).
struct TransferTicket {
  std::shared_ptr<VersionRun> run;
  size_t instance = 0;
  absl::Time queued_at;
  // kGiven: the second part of an exchange (core/exchange.h), queued
  // when the first landed; kAll: the instance's whole transfer, or the
  // first part of its exchange.
  TransferJob::Part part = TransferJob::Part::kAll;
};

// One destination rank's event channel and staging, keyed by the rank's
// participant id (Participant::channel_id: an adapter's ranks use their
// base rank's channel).
struct RankChannel {
  struct SentEvent {
    int64_t version = 0;
    v1::UpdateEventKind kind = v1::UPDATE_EVENT_KIND_UNSPECIFIED;
    bool needs_ack = false;
    int ack_status = 0;  // v1::AckStatus once acked
    std::string stream;
    std::string instance;
    uint64_t run_serial = 0;
  };
  uint64_t next_event_id = 1;
  std::deque<v1::UpdateEvent> outbox;   // not yet written to a stream
  // Events sent and not yet acked, by id, resent on re-subscribe: at
  // most one per instance (the rank's own, and each adapter's, whose
  // events share its channel), since a new event of an instance, or its
  // COMMIT or ABORT, ends what it was asked before.
  struct Awaiting {
    std::string instance;
    v1::UpdateEvent event;
  };
  std::map<uint64_t, Awaiting> awaiting;
  std::map<uint64_t, SentEvent> sent;   // recent events, by id
  uint64_t subscription = 0;  // generation of the live stream; 0: none
  uint64_t subscriptions = 0;
  EventSink* sink = nullptr;  // the live stream's; not owned
  std::shared_ptr<StagingArea> staging;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_VERSION_RUN_H_
