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
#ifndef FERRY_DAEMON_TRANSFER_LOCAL_EXECUTOR_H_
#define FERRY_DAEMON_TRANSFER_LOCAL_EXECUTOR_H_

#include <cstdint>

#include "absl/status/status.h"
#include "daemon/transfer/copy_router.h"
#include "daemon/transfer/transfer_executor.h"
#include "daemon/transfer/transfer_job.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace ferry {

class LocalExecutor : public TransferExecutor {
 public:
  // Neither is owned. `devices` may be unavailable (no GPUs here).
  LocalExecutor(CopyEngine* host_engine, DeviceMemory* devices);
  LocalExecutor(const LocalExecutor&) = delete;
  LocalExecutor& operator=(const LocalExecutor&) = delete;

  // Moves every byte of the job. CANCELLED when progress->cancel was set
  // (some bytes may have landed); UNIMPLEMENTED, before any byte moves, for
  // a box between host memory and GPU memory; INTERNAL for a buffer that
  // cannot be found (a bug); the CopyEngine's error otherwise.
  absl::Status Execute(const TransferJob& job) override;

 private:
  const CopyRouter router_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_LOCAL_EXECUTOR_H_
