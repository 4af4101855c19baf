// TransferChecksums: on-demand integrity of what the engines hold
// (Inspection.VerifyInstance, `ferryctl verify`).
//
// At transfer time, for an instance fed by the sources, the source side of
// every planned copy (core/plan.h: source rank/piece -> destination
// rank/piece, one box) is hashed with XXH3-64 (box_hash.h) where it is
// mapped: on this node from the source's MemoryMap, on a member by
// Peer.HashBoxes to that member. Hashing runs on threads of its own while
// the copy engine copies (source memory does not change until
// CommitVersion returns, docs/api.md), and the transfer waits for it
// before APPLY. A replica that relayed its version from another replica
// takes that replica's checksums: the same layout, piece for piece, so the
// same copies' destination boxes describe its memory too.
//
// When every rank acked APPLY, the instance's checksums of that version
// are kept (one set per instance: the plan the copies belong to, one
// 64-bit hash and a small reason code per copy). VerifyInstance then walks
// the same copies' destination side in the ranks' memory (this node's
// MemoryMaps, or Peer.HashBoxes on a member) and names every box whose
// checksum differs by parameter, rank and box.
//
// Not compared, and said so per (parameter, rank): fallback tensors (they
// are assembled in staging and handed to the engine's loader, so ferryd
// never sees their final place in the engine's memory), GPU memory on
// either end (not hashable on the CPU), and source boxes whose daemon
// could not hash them.
//
// Owner: the Server; the VersionCoordinator calls Start/Commit, the
// InspectionService Latest/Verify. Threading: thread-safe (one mutex for
// the kept sets; hashing runs without it).
#ifndef FERRY_DAEMON_TRANSFER_TRANSFER_CHECKSUMS_H_
#define FERRY_DAEMON_TRANSFER_TRANSFER_CHECKSUMS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/transfer/local_executor.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/peer.pb.h"

namespace ferry {

// Hashes boxes of memory that another node's daemon maps (Peer.HashBoxes).
class RemoteBoxHasher {
 public:
  virtual ~RemoteBoxHasher() = default;
  // One result per box of `request`, in order; the call's error otherwise.
  virtual absl::StatusOr<v1::HashBoxesResponse> HashBoxes(
      const std::string& node, const v1::HashBoxesRequest& request) = 0;
};

// The checksums of one delivery of a version to one instance.
struct InstanceChecksums {
  std::string stream;
  std::string instance;
  int64_t version = 0;
  std::shared_ptr<const StreamPlan> plan;
  int32_t planned = -1;    // this instance: index into plan->instances
  int32_t copies_of = -1;  // whose copies: plan->DirectPlan(copies_of)
  std::string relayed_from;  // "" or the replica these came from
  // Per copy of plan->DirectPlan(copies_of): its hash when
  // reason[k] == 0, else reasons[reason[k]] says why it was not hashed.
  struct Hashes {
    std::vector<uint64_t> hash;
    std::vector<uint16_t> reason;
    std::vector<std::string> reasons;  // [0] = "" (hashed)
  };
  std::shared_ptr<const Hashes> hashes;
};

class TransferChecksums {
 public:
  struct Options {
    bool enabled = true;
    int threads = 0;     // hashing threads per transfer (0: min(4, cores))
    std::string node;    // this daemon's node
    RemoteBoxHasher* remote = nullptr;  // members' memory; not owned
  };

  // Hashing that runs while a transfer copies.
  class Pending {
   public:
    ~Pending();  // waits
    // The checksums, once every box is hashed; call it when the transfer
    // has returned (`transferred`: it succeeded). The boxes of a member's
    // quantizer rank are hashed here, after a transfer that succeeded:
    // the member quantizes them into that rank's memory during it (FP8
    // in flight, route_quantizers.h).
    std::shared_ptr<const InstanceChecksums> Finish(bool transferred);

   private:
    friend class TransferChecksums;
    const TransferChecksums* owner_ = nullptr;
    TransferJob job_;
    std::shared_ptr<InstanceChecksums> result_;
    std::shared_ptr<InstanceChecksums::Hashes> hashes_;
    std::thread thread_;
  };

  explicit TransferChecksums(Options options);
  TransferChecksums(const TransferChecksums&) = delete;
  TransferChecksums& operator=(const TransferChecksums&) = delete;

  bool enabled() const { return options_.enabled; }

  // Starts hashing the sources of a job (or, for a relay, takes
  // `relayed`, the checksums of the replica it relays from: null when that
  // one has none). Null when checksums are off.
  std::unique_ptr<Pending> Start(
      const TransferJob& job, const std::string& stream, int64_t version,
      const std::string& instance,
      std::shared_ptr<const InstanceChecksums> relayed) const;

  // The instance committed `version` with `checksums` (null: none kept).
  // Drops the sets of instances whose ranks have left.
  void Commit(const std::string& instance, int64_t version,
              std::shared_ptr<const InstanceChecksums> checksums)
      ABSL_LOCKS_EXCLUDED(mu_);
  // The checksums of the instance's latest committed delivery, or null.
  std::shared_ptr<const InstanceChecksums> Latest(
      const std::string& instance) const ABSL_LOCKS_EXCLUDED(mu_);

  // Hashes the destination side of every copy in the ranks' memory and
  // compares. UNAVAILABLE when a member holding ranks cannot be reached.
  absl::StatusOr<v1::VerifyInstanceResponse> Verify(
      const InstanceChecksums& sums) const;

 private:
  int threads() const;
  // Hashes the source side of the job's copies into `out` (sized on the
  // first pass): all but those read from a member's quantizer rank
  // (`after_transfer` false), or only those.
  void HashSources(const TransferJob& job, bool after_transfer,
                   InstanceChecksums::Hashes* out) const;

  const Options options_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const InstanceChecksums>> kept_
      ABSL_GUARDED_BY(mu_);
};

// Peer.HashBoxes on the daemon that maps the memory: one result per box.
// `memory_of` finds a participant's map (null: not held here, NOT_FOUND).
absl::Status HashMappedBoxes(
    const v1::HashBoxesRequest& request,
    const std::function<std::shared_ptr<const MemoryMap>(const std::string&)>&
        memory_of,
    int threads, v1::HashBoxesResponse* response);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_TRANSFER_CHECKSUMS_H_
