// LocalExecutor: carries out one instance's part of a plan on this node.
//
// Role: for an instance whose ranks all paused, copies every planned box
// straight from a source rank's mapped region into a destination rank's
// region (a registered live buffer, or the rank's staging for a fallback
// tensor): one copy per byte (design §4, "same node"). CopyRouter
// (copy_router.h) picks the engine of each box by where its ends live
// (host memcpy, or a GPU's kernels); a bucket touching several GPUs runs on
// all of them at once. Every box is routed before any byte moves, so a box
// no engine can do (host memory that cannot be pinned for a GPU) fails the
// job clean (UNIMPLEMENTED).
// A relayed instance (a replica fed from an earlier replica, plan.h)
// copies each of its pieces from the same piece of the replica it relays
// from instead; the caller only asks for that once that replica's own
// transfer completed, which is what "relays in stage order" means here.
// Progress counters (bytes done / total) are updated after every bucket;
// a cancel flag is checked between buckets.
//
// Owner: the VersionCoordinator's transfer worker. Threading: Execute may
// run on several threads at once (the CopyEngines are thread-safe); a
// TransferJob and its TransferProgress belong to one call.
#ifndef FERRY_DAEMON_LOCAL_EXECUTOR_H_
#define FERRY_DAEMON_LOCAL_EXECUTOR_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/copy_router.h"
#include "daemon/memory_map.h"
#include "daemon/plan_cache.h"
#include "daemon/staging_area.h"
#include "proto/ferry/v1/version.pb.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace ferry {

// Where one destination rank's buffers are in this process.
struct RankMemory {
  std::shared_ptr<const MemoryMap> client;  // registered regions
  std::shared_ptr<const StagingArea> staging;
  // Base of staging buffer kStagingBufferBit | k (the rank's k-th fallback
  // tensor), by k.
  std::vector<uint8_t*> staging_bases;

  // Where a core buffer id is (base null when unknown).
  BufferPlace Find(uint32_t buffer) const;
};

// Shared between the transfer and whoever watches it (GetProgress, abort).
struct TransferProgress {
  std::atomic<int64_t> bytes_moved{0};
  std::atomic<int64_t> bytes_total{0};
  std::atomic<bool> cancel{false};
};

struct TransferJob {
  std::shared_ptr<const StreamPlan> plan;
  int32_t instance = 0;  // index into plan->instances
  // True: copy from plan->plan's relay_from replica (whose memory is
  // `relay_source`); false: from the sources, as plan->direct_plan() says.
  bool relay = false;
  std::vector<RankMemory> destination;   // by tp rank
  std::vector<RankMemory> relay_source;  // by tp rank, when relay
  TransferProgress* progress = nullptr;
  // Remote executors: the APPLY detail of each tp rank (staging on the
  // destination's node), filled by Execute. Empty: the coordinator's own
  // staging.
  std::vector<v1::ApplyDetail>* apply = nullptr;
};

// Carries out jobs whose destination is on another node (remote_transfers.h).
class RemoteExecutor {
 public:
  virtual ~RemoteExecutor() = default;
  // Whether the job's destination ranks are on another node.
  virtual bool Handles(const TransferJob& job) const = 0;
  virtual absl::Status Execute(const TransferJob& job) = 0;
};

class LocalExecutor {
 public:
  // Neither is owned. `devices` may be unavailable (no GPUs here).
  LocalExecutor(CopyEngine* host_engine, DeviceMemory* devices);
  LocalExecutor(const LocalExecutor&) = delete;
  LocalExecutor& operator=(const LocalExecutor&) = delete;

  // Bytes the job moves (for progress before it starts).
  static int64_t JobBytes(const TransferJob& job);

  // Moves every byte of the job. CANCELLED when progress->cancel was set
  // (some bytes may have landed); UNIMPLEMENTED, before any byte moves, for
  // a box between host memory and GPU memory; INTERNAL for a buffer that
  // cannot be found (a bug); the CopyEngine's error otherwise.
  absl::Status Execute(const TransferJob& job);

 private:
  const CopyRouter router_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_LOCAL_EXECUTOR_H_
