// DeviceMemory: GPU memory as ferryd sees it, without depending on CUDA.
//
// Role: the daemon's side of the GPU data path (design §4, "same node,
// GPU"). Registration hands each IpcRegion a client sends to Map, which
// opens the allocation it names once (cuda/ipc's IpcMemoryCache) and checks
// that the region lies inside it; the transfer copies between mapped device
// addresses with Engine(gpu), whose kernels run on that GPU (the
// destination's, reading the source over NVLink when it sits on another
// GPU). A GPU destination rank's fallback staging stays in host shared
// memory, which the client maps as for a host rank, and is made
// GPU-accessible with PinHost so that the same kernels write it.
//
// A client's host shared memory that a box pairs with GPU memory (a host
// trainer feeding GPU engines, GPU trainers writing host engines) is pinned
// the same way, once, the first time a transfer needs it (MemoryMap
// PinForGpus), and the GPU kernels read or write it over PCIe.
//
// Between nodes, GPU memory travels over NCCL (cuda/nccl): the sending
// daemon makes a communicator id (NewFabricId), hands it to the receiving
// daemon (Peer.OpenChannel), and both join a two-rank communicator on one
// GPU each (JoinFabric); the Channel they get packs and unpacks with the
// GPUs' kernels, so the bytes never pass through host memory.
//
// Implementations: cuda/gpu_device_memory.h (real GPUs, linked into ferryd
// when it is built with CUDA), and UnavailableDeviceMemory below, which
// answers every request with the reason there are no GPUs here (built
// without CUDA, no driver, no device, or --gpus=false). Nothing in daemon/
// ever dereferences a device address on the CPU: MemoryMap marks device
// regions, and only a CopyEngine from Engine() touches them.
//
// Threading: implementations are thread-safe.
#ifndef FERRY_TRANSPORT_DEVICE_MEMORY_H_
#define FERRY_TRANSPORT_DEVICE_MEMORY_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace ferry {

// A GPU of this node as the daemon uses it (GetHealth lists them).
struct GpuInfo {
  int ordinal = 0;           // the daemon's own ordinal
  std::string uuid;          // "GPU-1f2e..." as nvidia-smi prints it
  std::string name;          // "NVIDIA H200"
  int64_t memory_bytes = 0;  // total device memory
};

// Where a client's GPU region lives: in the cudaMalloc allocation whose
// cudaIpcMemHandle_t is `ipc_handle` (64 bytes), `allocation_offset_bytes`
// from its base, on the GPU with UUID `gpu_uuid`.
struct IpcRegion {
  std::string ipc_handle;
  int64_t allocation_offset_bytes = 0;
  std::string gpu_uuid;
};

// A client allocation mapped into ferryd. Unmapped (its reference in the
// IPC cache dropped) when destroyed.
class DeviceRegion {
 public:
  virtual ~DeviceRegion() = default;
  // The region's first byte as a device address: for kernels only.
  virtual uint8_t* data() const = 0;
  // The daemon's ordinal of the GPU that holds the memory.
  virtual int gpu() const = 0;
};

// GPU memory this daemon allocated and exports to a client (a GPU rank's
// fallback staging): the client opens `ipc_handle` with
// cudaIpcOpenMemHandle. Freed when destroyed; a client that still has it
// open keeps the pages until it closes its handle.
class ExportedDeviceBuffer {
 public:
  virtual ~ExportedDeviceBuffer() = default;
  virtual uint8_t* data() const = 0;  // device address: for kernels only
  virtual int gpu() const = 0;        // the daemon's ordinal
  // cudaIpcMemHandle_t's 64 bytes.
  virtual const std::string& ipc_handle() const = 0;
};

// Host memory made accessible to the GPUs' kernels (page-locked and
// mapped). Unpinned when destroyed, which must happen before the memory is
// unmapped.
class PinnedHost {
 public:
  virtual ~PinnedHost() = default;
};

class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;

  // OK when GPU memory can be registered here; otherwise FAILED_PRECONDITION
  // saying why not.
  virtual absl::Status Available() const = 0;
  // The GPUs this daemon uses (GetHealth.devices); empty when unavailable.
  virtual std::vector<GpuInfo> Devices() const = 0;

  // Maps `size_bytes` of the allocation `region.ipc_handle` names, from
  // `region.allocation_offset_bytes`. The allocation is opened once however
  // many regions name it. FAILED_PRECONDITION when unavailable or the GPU
  // (by UUID) is not one this daemon sees; INVALID_ARGUMENT when the handle
  // is malformed or the region does not lie inside the allocation; the
  // driver's error when the handle cannot be opened. Messages do not name
  // the caller; MemoryMap prefixes the participant and region.
  virtual absl::StatusOr<std::unique_ptr<DeviceRegion>> Map(
      const IpcRegion& region, int64_t size_bytes) = 0;

  // Makes [data, data + bytes) of host memory accessible to every GPU's
  // kernels at the same address. `read_only`: the memory is mapped
  // read-only here (a source's region); kernels only read it.
  virtual absl::StatusOr<std::unique_ptr<PinnedHost>> PinHost(
      uint8_t* data, int64_t bytes, bool read_only) = 0;

  // `bytes` of GPU memory on GPU `gpu`, exportable over CUDA IPC.
  // RESOURCE_EXHAUSTED when the GPU has not that much free;
  // FAILED_PRECONDITION when unavailable.
  virtual absl::StatusOr<std::unique_ptr<ExportedDeviceBuffer>>
  AllocateExported(int gpu, int64_t bytes) = 0;

  // The copy engine whose kernels run on GPU `gpu` (an ordinal of Map's
  // DeviceRegion::gpu). It copies between device addresses of any GPU of
  // this node and pinned host memory. Null when `gpu` is not a GPU here.
  virtual CopyEngine* Engine(int gpu) = 0;

  // The daemon's ordinal of the GPU with this UUID; empty: its first GPU.
  // -1 when it has no such GPU.
  virtual int GpuOf(const std::string& uuid) const = 0;

  // A new NCCL communicator id (ncclGetUniqueId's 128 bytes).
  virtual absl::StatusOr<std::string> NewFabricId() = 0;

  // Joins the two-rank communicator `id` at `epoch` as `rank` on GPU `gpu`
  // and returns the Channel to the other rank (rank 0 sends, rank 1
  // receives). Blocks until both ranks joined; DEADLINE_EXCEEDED past
  // `deadline` (the half-made communicator is aborted, never waited on).
  // The channel owns its communicator and aborts it when destroyed.
  virtual absl::StatusOr<std::unique_ptr<Channel>> JoinFabric(
      int gpu, const std::string& id, int rank, int64_t epoch,
      absl::Time deadline) = 0;
};

// Every request fails FAILED_PRECONDITION with `reason` ("this ferryd was
// built without CUDA", "no GPU: ...").
std::unique_ptr<DeviceMemory> UnavailableDeviceMemory(std::string reason);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_DEVICE_MEMORY_H_
