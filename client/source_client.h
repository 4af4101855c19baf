// SourceClient: one trainer rank of a stream, registered with its ferryd.
//
// Role: a trainer rank (Megatron, FSDP, ...) declares which boxes of which
// checkpoint parameters it holds in its registered memory (pieces), then for
// each step calls PublishVersion(v) once its memory holds v. ferry reads
// that memory only during CommitVersion, so the rank must not write it until
// PublishVersion returns (docs/api.md, "Version protocol").
//
// Usage (every rank runs the same code, SPMD):
//   auto arena = SharedTensorArena::Create("policy.r3", bytes, /*region*/0);
//   SourceLayout layout{model, pieces_into_region_0, {(*arena)->Describe()}};
//   auto source = SourceClient::Register(connection, options, layout);
//   ... write v's weights into the arena ...
//   auto outcome = (*source)->PublishVersion(v);  // per-instance results
//
// Lifetime: Register returns the only owner. The destructor stops the
// heartbeats and deregisters (a 5 s deadline); the memory the layout points
// into (e.g. the SharedTensorArena) must outlive the client.
//
// Daemon restarts: when ferryd no longer knows the registration (it was
// restarted, or the lease ran out: NOT_FOUND / PERMISSION_DENIED for the
// handle), the client registers again with the same layout and memory
// (never with replace_existing: a rank that took over this slot keeps it):
// at once, from its rejoin thread, when a heartbeat finds the lease lost
// (retrying while the daemon is unavailable), so that every trainer rank
// is back before the next version; and when BeginVersion finds it gone,
// waiting for the daemon up to the connection's rpc_timeout, then retrying
// once. A version whose CommitVersion was cut off by a restart fails; the
// next version goes through the new registration.
//
// Threading: a heartbeat thread (LeaseKeeper) and a rejoin thread of its
// own. Begin/Commit/Abort/PublishVersion may be called from any one thread
// at a time.
#ifndef FERRY_CLIENT_SOURCE_CLIENT_H_
#define FERRY_CLIENT_SOURCE_CLIENT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "client/lease_keeper.h"
#include "core/piece.h"
#include "proto/ferry/v1/registration.pb.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

struct SourceOptions {
  std::string stream;   // required, e.g. "policy"
  int32_t rank = 0;     // 0 <= rank < world_size
  int32_t world_size = 1;
  std::string node;     // optional check against the daemon's node name
  int32_t pid = 0;      // 0: this process's pid
  bool replace_existing = false;  // take over a restarted rank's slot
  // CommitVersion blocks until every instance settles; the daemon's own
  // version timeout bounds that, this is the client's outer bound.
  absl::Duration commit_timeout = absl::Minutes(10);
};

// What the rank holds. `pieces[i].param` indexes `model`; `pieces[i].buffer`
// is a region id of `regions`. Every parameter of `model` is declared (a
// rank may declare parameters it holds no piece of: PP, EP).
struct SourceLayout {
  ModelSpec model;
  std::vector<Piece> pieces;
  std::vector<v1::MemoryRegion> regions;  // e.g. SharedTensorArena::Describe
};

// Checks what the daemon would reject for malformed input, before any RPC:
// names, rank range, region ids (unique, < 2^31, size > 0), dtypes and
// shapes, every piece's box inside its parameter and its bytes inside its
// region. INVALID_ARGUMENT naming the rank, the parameter and the box.
absl::Status ValidateSourceRegistration(const SourceOptions& options,
                                        const SourceLayout& layout);

// The registration message (no validation; see above).
absl::StatusOr<v1::SourceRegistration> BuildSourceRegistration(
    const SourceOptions& options, const SourceLayout& layout);

// The outcome of one version for this stream.
struct PublishOutcome {
  int64_t version = 0;
  std::vector<v1::InstanceStatus> instances;  // COMMITTED or ABORTED each
  bool all_committed() const;
  // "2 committed, 1 aborted (vllm-1: tp rank 0 did not ack PAUSE ...)"
  std::string Summary() const;
};

class SourceClient {
 public:
  // Validates, registers, starts heartbeats.
  static absl::StatusOr<std::unique_ptr<SourceClient>> Register(
      const Connection& connection, const SourceOptions& options,
      const SourceLayout& layout);

  ~SourceClient();  // stops heartbeats, then deregisters
  SourceClient(const SourceClient&) = delete;
  SourceClient& operator=(const SourceClient&) = delete;

  // BeginVersion(v) then CommitVersion(v). Blocks until every instance
  // settled. A whole-version abort is ABORTED; per-instance aborts are in
  // the outcome, not errors.
  absl::StatusOr<PublishOutcome> PublishVersion(int64_t version);

  // The steps one by one, for trainers that begin a version early (engines
  // then prepare while the optimizer runs). BeginVersion returns the
  // instance ids the version goes to.
  absl::StatusOr<std::vector<std::string>> BeginVersion(int64_t version);
  absl::StatusOr<PublishOutcome> CommitVersion(int64_t version);
  absl::Status AbortVersion(int64_t version, const std::string& reason);

  v1::ParticipantHandle handle() const ABSL_LOCKS_EXCLUDED(mu_);
  // OK while the lease is held (see LeaseKeeper).
  absl::Status lease_status() const ABSL_LOCKS_EXCLUDED(mu_);
  // How many times the client registered again after losing its
  // registration (daemon restart, lost lease).
  int reregistrations() const ABSL_LOCKS_EXCLUDED(mu_);
  // "source policy rank 3"
  const std::string& who() const { return who_; }

 private:
  SourceClient(Connection connection, SourceOptions options,
               v1::RegisterSourceRequest request,
               v1::RegisterSourceResponse response);

  // Registers again with request_ (replace_existing off) once the daemon
  // answers, waiting at most `ready_timeout` for it; OK at once when the
  // registration `lost` was already replaced (by the other caller: a lost
  // lease and a BeginVersion may both find it gone).
  absl::Status Reregister(const v1::ParticipantHandle& lost,
                          absl::Duration ready_timeout)
      ABSL_LOCKS_EXCLUDED(mu_, reregister_mu_);
  // The rejoin thread: registers again as soon as the lease is lost (the
  // daemon restarted, or the lease ran out), retrying while the daemon is
  // unavailable, so a trainer rank is back before its next version.
  void RejoinLoop() ABSL_LOCKS_EXCLUDED(mu_);
  std::unique_ptr<LeaseKeeper> NewLeaseKeeper(const v1::ParticipantHandle& h,
                                              int64_t lease_ms);
  // BeginVersion's RPC, once.
  absl::StatusOr<std::vector<std::string>> BeginOnce(int64_t version);

  const Connection connection_;
  const SourceOptions options_;
  v1::RegisterSourceRequest request_;  // for Reregister
  const std::string who_;
  absl::Mutex reregister_mu_;  // one re-registration at a time
  mutable absl::Mutex mu_;
  v1::ParticipantHandle handle_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<LeaseKeeper> lease_ ABSL_GUARDED_BY(mu_);
  int reregistrations_ ABSL_GUARDED_BY(mu_) = 0;
  bool lease_lost_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread rejoin_;  // RejoinLoop
};

}  // namespace ferry

#endif  // FERRY_CLIENT_SOURCE_CLIENT_H_
