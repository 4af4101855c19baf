// The cuda_ipc backend: same-node GPU copies, one copy per byte.
//
// The daemon maps each source rank's and destination rank's registered
// allocations (IpcMemoryCache) on one GPU of the node, and the box copy
// kernel (cuda/kernels) moves each box straight from the source region to
// the destination region: across NVLink when they live on different GPUs
// (the mapping enables peer access), within HBM when on the same one.
// Design §4, "same node, GPU". A whole Run is one kernel launch, whatever
// the number of boxes, their ranks or unit sizes.
//
// Viability: CreateCudaIpcCopyEngine answers NotViable (cuda/device.h)
// where there is no GPU, so the daemon can fall back or report it.
//
// Threading: the engine is thread-safe; concurrent Runs use separate
// streams (a small pool of them), so they overlap on the GPU.
#ifndef FERRY_CUDA_IPC_CUDA_IPC_COPY_ENGINE_H_
#define FERRY_CUDA_IPC_CUDA_IPC_COPY_ENGINE_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace ferry {

struct CudaIpcCopyEngineOptions {
  // The GPU whose kernels copy. Every address in a Run must be usable from
  // it: its own allocations, or IPC mappings opened for it.
  int device = 0;
  // A Run not finished by then fails DEADLINE_EXCEEDED (the GPU is wedged;
  // the destinations are dirty). No wait in the engine is unbounded.
  absl::Duration timeout = absl::Seconds(120);
};

// The engine, or NotViable (no driver, no device) or INVALID_ARGUMENT (no
// such device).
absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaIpcCopyEngine(
    const CudaIpcCopyEngineOptions& options = {});

}  // namespace ferry

#endif  // FERRY_CUDA_IPC_CUDA_IPC_COPY_ENGINE_H_
