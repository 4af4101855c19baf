// DestinationClient: one TP rank of an inference engine instance, registered
// with its ferryd, following the version protocol.
//
// Role: an engine rank (vLLM/SGLang worker) registers its live parameters,
// as an engine parameter table that ferry resolves (core/layout_resolution.h)
// or as explicit pieces, in memory it registered (e.g. a SharedTensorArena).
// It then follows its Subscribe stream: for each version the daemon sends
// PREPARE, PAUSE, APPLY, then COMMIT or ABORT (docs/api.md, "Version
// protocol"). The client turns each event into a call of the user's
// callback and acks it with the callback's result.
//
//   on_prepare(v)          get ready to pause (stop admitting requests)
//   on_pause(v)            return at a safe point: no forward pass reads
//                          the weights; ferry then writes the live buffers
//   on_apply(v, tensors)   direct bytes are in place; hand the fallback
//                          tensors (whole checkpoint tensors in the daemon's
//                          staging, mapped read-only-by-convention here) to
//                          the engine's loader; return once the rank holds v
//   on_commit(v)           resume serving at v
//   on_abort(v, why, dirty) resume the previous version (clean) or stay
//                          paused (dirty: a retry or the next version follows)
//   on_offload(ids, kept)  Lifecycle.Offload, after a PAUSE: release the
//                          memory of these regions (the daemon has
//                          unmapped them); the rank serves nothing until
//                          it is onloaded
//   on_onload(ids)         Lifecycle.Onload: allocate these regions again
//                          (same ids and sizes) and return them; the client
//                          registers them (Registry.UpdateRegions) and
//                          acks. The rank stays paused until COMMIT (it
//                          was refilled) or ABORT(dirty) (the stream's
//                          next version fills it)
// LoRA adapters (Lifecycle.LoadAdapter; events with adapter_name set, a
// sequence of their own per adapter, interleaved with the base model's):
//   on_adapter_pause(name, v)   stop using the adapter (the base model and
//                               other adapters keep serving)
//   on_adapter_apply(name, v, config_json, shares)
//                               load the adapter's tensors (this rank's
//                               shares: FallbackTensorView::share) under
//                               the name, replacing what it held
//   on_adapter_commit(name, v)  serve the adapter at v
//   on_adapter_abort(name, v, why, dirty)
//                               keep the previous adapter (clean), or do
//                               not use it until a later commit (dirty)
//   on_adapter_unload(name)     drop it; return once no request uses it
// A callback that returns an error acks FAILED with its message, which
// aborts the instance's version. A null callback acks OK, except the
// offload ones and on_adapter_apply / on_adapter_unload: without them
// those events are acked FAILED, saying so.
//
// Lifetime: Register returns the only owner. The destructor cancels the
// stream, joins the reader thread, stops heartbeats, deregisters (5 s
// deadline) and unmaps staging. The registered memory must outlive it.
//
// Daemon restarts: when the Subscribe stream breaks (UNAVAILABLE) the reader
// subscribes again with backoff; when the daemon no longer knows the
// registration (it was restarted, or the lease ran out: NOT_FOUND /
// PERMISSION_DENIED) and options.reregister is set, it registers again with
// the same layout and memory, held_version = the latest version it saw
// COMMIT for or acked APPLY OK for (a COMMIT can die with its daemon after
// the instance committed), and never with replace_existing (a rank that took over this slot keeps
// it); the callbacks then see the new daemon's events.
//
// Threading: callbacks run on the client's reader thread, one at a time, in
// event order; they must not destroy the client. A heartbeat thread of its
// own. The public methods are thread-safe.
#ifndef FERRY_CLIENT_DESTINATION_CLIENT_H_
#define FERRY_CLIENT_DESTINATION_CLIENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "client/connection.h"
#include "client/lease_keeper.h"
#include "core/layout_resolution.h"
#include "core/piece.h"
#include "proto/ferry/v1/registration.pb.h"
#include "proto/ferry/v1/version.pb.h"
#include "transport/shared_memory.h"

namespace ferry {

struct DestinationOptions {
  std::string instance_id;  // required, e.g. "vllm-0"
  std::string stream;       // required: the stream the instance follows
  int32_t tp_rank = 0;      // 0 <= tp_rank < tp_size
  int32_t tp_size = 1;
  std::string node;         // optional check against the daemon's node name
  int32_t pid = 0;          // 0: this process's pid
  int64_t held_version = 0; // what the live buffers hold now (0: base)
  bool replace_existing = false;
  // Register again when the daemon lost the registration (restart, lease).
  bool reregister = true;
  // Wait before subscribing again after the stream broke (daemon restart,
  // network); doubles up to 5 s.
  absl::Duration resubscribe_backoff = absl::Milliseconds(200);
};

// The rank's layout: an engine table (its params' `buffer` are region ids;
// tp_rank, tp_size and node come from DestinationOptions) or explicit
// pieces (`model` names their parameters). Use the factories.
struct DestinationLayout {
  static DestinationLayout FromEngineTable(EngineTable table,
                                           std::vector<v1::MemoryRegion> regions);
  static DestinationLayout FromPieces(ModelSpec model, std::vector<Piece> pieces,
                                      std::vector<v1::MemoryRegion> regions);

  std::optional<EngineTable> engine_table;
  ModelSpec model;            // explicit pieces only
  std::vector<Piece> pieces;  // explicit pieces only
  std::vector<v1::MemoryRegion> regions;
};

// One whole checkpoint tensor the engine's loader must consume, in the
// daemon's staging memory (row-major, contiguous). `bytes` is valid during
// the on_apply call only: the daemon may reuse staging afterwards.
struct FallbackTensorView {
  std::string parameter;  // checkpoint name
  DType dtype = DType::kInvalid;
  Dims shape;  // the global shape
  // Adapter tensors: the box of the tensor `bytes` hold (row-major,
  // contiguous, shape share->extent); none: the whole tensor.
  std::optional<Box> share;
  absl::Span<const uint8_t> bytes;
};

struct DestinationCallbacks {
  std::function<absl::Status(int64_t version)> on_prepare;
  std::function<absl::Status(int64_t version)> on_pause;
  std::function<absl::Status(int64_t version,
                             const std::vector<FallbackTensorView>& fallback)>
      on_apply;
  std::function<void(int64_t version)> on_commit;
  std::function<void(int64_t version, const std::string& reason, bool dirty)>
      on_abort;
  std::function<absl::Status(const std::vector<uint32_t>& region_ids,
                             bool host_copy_kept)>
      on_offload;
  std::function<absl::StatusOr<std::vector<v1::MemoryRegion>>(
      const std::vector<uint32_t>& region_ids)>
      on_onload;
  std::function<absl::Status(const std::string& adapter, int64_t version)>
      on_adapter_pause;
  std::function<absl::Status(const std::string& adapter, int64_t version,
                             const std::string& config_json,
                             const std::vector<FallbackTensorView>& shares)>
      on_adapter_apply;
  std::function<void(const std::string& adapter, int64_t version)>
      on_adapter_commit;
  std::function<void(const std::string& adapter, int64_t version,
                     const std::string& reason, bool dirty)>
      on_adapter_abort;
  std::function<absl::Status(const std::string& adapter)> on_adapter_unload;
};

// Client-side checks before any RPC (names, ranks, regions, the table's
// parameters inside their regions, explicit pieces inside theirs).
absl::Status ValidateDestinationRegistration(const DestinationOptions& options,
                                             const DestinationLayout& layout);

absl::StatusOr<v1::DestinationRegistration> BuildDestinationRegistration(
    const DestinationOptions& options, const DestinationLayout& layout);

class DestinationClient {
 public:
  // Validates, registers, starts heartbeats and the Subscribe reader.
  static absl::StatusOr<std::unique_ptr<DestinationClient>> Register(
      const Connection& connection, const DestinationOptions& options,
      const DestinationLayout& layout, DestinationCallbacks callbacks);

  ~DestinationClient();
  DestinationClient(const DestinationClient&) = delete;
  DestinationClient& operator=(const DestinationClient&) = delete;

  // Asks the daemon (Versions.WaitForVersion) to wait until this instance
  // settled version v, at most `timeout`; returns its status. The status
  // may be ABORTED: that is an outcome, not an error.
  absl::StatusOr<v1::InstanceStatus> WaitForVersion(int64_t version,
                                                    absl::Duration timeout);

  // Waits for this rank's own events: OK once it saw COMMIT(v' >= v);
  // ABORTED (with the reason) once it saw ABORT(v) and no later commit;
  // DEADLINE_EXCEEDED after `timeout`; the stream's error if it ended.
  absl::Status AwaitCommitted(int64_t version, absl::Duration timeout)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Lifecycle.SwapModel for this rank: switches it to a new registration
  // (another model, layout or stream: `options` keeps instance_id, tp_rank
  // and tp_size; held_version is what the new buffers hold) together with
  // the instance's other ranks, which must call too (docs/api.md, "Model
  // swap"). Blocks until the instance switched (OK: the client now follows
  // the new registration, its events and handle) or did not (the error;
  // the client stays on the old registration). The new layout's memory must
  // outlive the client, as the old one's.
  absl::Status SwapModel(const DestinationOptions& options,
                         const DestinationLayout& layout,
                         absl::Duration timeout = absl::Minutes(2))
      ABSL_LOCKS_EXCLUDED(mu_);

  // The latest version this rank saw COMMIT for (held_version before).
  int64_t committed_version() const ABSL_LOCKS_EXCLUDED(mu_);
  // OK while the registration and its event stream are alive (or being
  // re-established, with options.reregister); else why not.
  absl::Status status() const ABSL_LOCKS_EXCLUDED(mu_);
  v1::ParticipantHandle handle() const ABSL_LOCKS_EXCLUDED(mu_);
  // How many times the client registered again (daemon restart, lease).
  int reregistrations() const ABSL_LOCKS_EXCLUDED(mu_);
  // "instance vllm-0 tp rank 1"
  const std::string& who() const { return who_; }

 private:
  // A staging region the daemon exported, mapped into this process.
  struct MappedStaging {
    SharedMemoryRegion region;
    int64_t offset = 0;  // file_offset_bytes: the region starts here
    int64_t size = 0;
  };

  DestinationClient(Connection connection, DestinationOptions options,
                    v1::RegisterDestinationRequest request,
                    v1::RegisterDestinationResponse response,
                    DestinationCallbacks callbacks);

  // Reader thread: registers again until it succeeds (true), the client
  // stops or the daemon refuses for good (false, stream_status_ set).
  bool Reregister() ABSL_LOCKS_EXCLUDED(mu_);

  void ReadEvents() ABSL_LOCKS_EXCLUDED(mu_);  // the reader thread
  // Runs the callback for one event and acks it. Reader thread only.
  void HandleEvent(const v1::UpdateEvent& event);
  // The callback's verdict on one event (OK or why not).
  absl::Status Dispatch(const v1::UpdateEvent& event) ABSL_LOCKS_EXCLUDED(mu_);
  // Maps the APPLY's staging regions (those of the base model, or of
  // `adapter`: each keeps its own set) and views its tensors.
  absl::StatusOr<std::vector<FallbackTensorView>> MapApply(
      const v1::ApplyDetail& apply, const std::string& adapter = "");
  // An event with adapter_name set.
  absl::Status DispatchAdapter(const v1::UpdateEvent& event);
  // ONLOAD: on_onload's regions registered (Registry.UpdateRegions) and
  // kept for a later re-registration.
  absl::Status Onload(const v1::UpdateEvent& event) ABSL_LOCKS_EXCLUDED(mu_);
  void Ack(const v1::UpdateEvent& event, const absl::Status& result);

  const Connection connection_;
  const DestinationOptions options_;
  const std::string who_;
  const DestinationCallbacks callbacks_;

  // Reader-thread-only state (no lock: only ReadEvents and what it calls
  // touch it).
  // By adapter name ("": the base model), by region id.
  std::map<std::string, std::map<uint32_t, MappedStaging>> staging_;
  // The verdicts acked for recent events, by id: the daemon resends what
  // it did not hear an ack for (after a resubscription), and that gets the
  // same verdict without running the callback twice.
  std::map<uint64_t, absl::Status> verdicts_;
  // The latest version this rank acked APPLY OK for: its buffers hold it
  // even when the COMMIT that followed never arrived (its daemon died).
  int64_t applied_version_ = 0;

  mutable absl::Mutex mu_;
  // What Reregister sends: the registration in force (SwapModel replaces
  // it) and its stream.
  v1::RegisterDestinationRequest request_ ABSL_GUARDED_BY(mu_);
  std::string stream_ ABSL_GUARDED_BY(mu_);
  // A SwapModel call is in flight: an ended stream waits for its outcome
  // instead of registering the old layout again.
  bool swapping_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t swaps_ ABSL_GUARDED_BY(mu_) = 0;  // swaps done
  v1::ParticipantHandle handle_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<LeaseKeeper> lease_ ABSL_GUARDED_BY(mu_);
  int reregistrations_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The open Subscribe call, to cancel from the destructor.
  grpc::ClientContext* stream_context_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t committed_version_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t aborted_version_ ABSL_GUARDED_BY(mu_) = 0;
  std::string abort_reason_ ABSL_GUARDED_BY(mu_);
  absl::Status stream_status_ ABSL_GUARDED_BY(mu_);  // why the stream ended

  std::thread reader_;  // started last
};

}  // namespace ferry

#endif  // FERRY_CLIENT_DESTINATION_CLIENT_H_
