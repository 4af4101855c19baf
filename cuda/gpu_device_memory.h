// The GPUs of this node behind transport/device_memory.h: what ferryd uses to
// register client GPU memory and copy between it (design §4, "same node,
// GPU").
//
// At creation it finds every GPU this process sees, names each by UUID,
// enables peer access between every pair that supports it (so a kernel on
// the destination's GPU reads a source on another GPU over NVLink), and
// builds one cuda_ipc CopyEngine per GPU. Map opens each client allocation
// once through IpcMemoryCache, on the GPU that holds it, and checks the
// region against the allocation's real extent (cuMemGetAddressRange) so a
// wrong offset is an INVALID_ARGUMENT at registration, never an illegal
// address fault in a kernel, which would poison the daemon's CUDA context.
//
// JoinFabric makes a two-rank NCCL communicator (non-blocking init, every
// wait bounded, aborted on error; cuda/nccl) and an NCCL channel on it.
//
// ferryd must see every GPU its clients use: run it without
// CUDA_VISIBLE_DEVICES (or with all of them).
//
// Threading: thread-safe.
#ifndef FERRY_CUDA_GPU_DEVICE_MEMORY_H_
#define FERRY_CUDA_GPU_DEVICE_MEMORY_H_

#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/device_memory.h"

namespace ferry {
namespace gpu {

struct GpuDeviceMemoryOptions {
  // Bound on one CopyEngine::Run (cuda_ipc_copy_engine.h).
  absl::Duration copy_timeout = absl::Seconds(120);
  // Each of the two device staging slots of an NCCL channel to another
  // daemon (nccl_channel.h).
  int64_t fabric_staging_bytes = 64 << 20;
};

// NotViable (cuda/device.h) where there is no driver or no GPU.
absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateGpuDeviceMemory(
    const GpuDeviceMemoryOptions& options = {});

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_GPU_DEVICE_MEMORY_H_
