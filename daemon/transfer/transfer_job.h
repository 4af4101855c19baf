// TransferJob: one instance's part of a version's transfer, as the
// VersionCoordinator's transfer worker hands it to an executor: the plan,
// which instance, whether it relays from a replica, where each destination
// rank's memory is in this process (RankMemory), the progress counters it
// updates (TransferProgress), and for executors that reach other daemons
// (RouteSender, route_sender.h) the APPLY details they fill. The executors
// (transfer_executor.h): LocalExecutor (local_executor.h) runs the jobs
// that stay on this node, RouteSender those that reach other nodes.
//
// Threading: a job and its progress belong to one Execute call; progress
// is read by others (GetProgress) and cancel set by others (abort).
#ifndef FERRY_DAEMON_TRANSFER_TRANSFER_JOB_H_
#define FERRY_DAEMON_TRANSFER_TRANSFER_JOB_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "daemon/memory/memory_map.h"
#include "daemon/memory/staging_area.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/transfer/copy_router.h"
#include "proto/ferry/v1/version.pb.h"

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
  // Delta versions (delta_routes.h): of the bytes moved between nodes,
  // those that went as patches, the patches' bytes on the wire, and the
  // bytes of the 2-byte chunks that changed.
  std::atomic<int64_t> patched_bytes{0};
  std::atomic<int64_t> patch_bytes{0};
  std::atomic<int64_t> changed_bytes{0};
  std::atomic<bool> cancel{false};
};

struct TransferJob {
  std::shared_ptr<const StreamPlan> plan;
  int32_t instance = 0;  // index into plan->instances
  uint64_t run = 0;      // the version run's serial (FP8 in flight quantizes once per run)
  int64_t version = 0;   // the run's version
  // Delta versions: the version the instance holds exactly as ferryd wrote
  // it (InstanceStatus.patch_base), for patches against it; 0: dense.
  int64_t delta_base = 0;
  // True: copy from plan->plan's relay_from replica (whose memory is
  // `relay_source`); false: from the sources, as plan->DirectPlan() says.
  bool relay = false;
  // Of an instance with an exchange (StreamPlan::ExchangeOf,
  // core/exchange.h), which of DirectPlan's buckets: all of them, those
  // its partner does not give it (from the sources), or those it does.
  enum class Part { kAll, kFirst, kGiven };
  Part part = Part::kAll;
  // With kGiven: from the partner's live buffers, rank r from rank r
  // (its Participants' memory); false: from the sources.
  bool from_partner = false;
  std::vector<RankMemory> destination;   // by tp rank
  std::vector<RankMemory> relay_source;  // by tp rank, when relay
  TransferProgress* progress = nullptr;
  // Remote executors: the APPLY detail of each tp rank (staging on the
  // destination's node), filled by Execute. Empty: the coordinator's own
  // staging.
  std::vector<v1::ApplyDetail>* apply = nullptr;
};

// Bytes the job moves (for progress before it starts): relayed or from
// the sources, an instance receives all of its bytes. Every executor sets
// TransferProgress::bytes_total to it.
int64_t JobBytes(const TransferJob& job);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_TRANSFER_JOB_H_
