// CopyRouter: which CopyEngine moves a box, by where its two ends live.
//
//   host -> host      the host engine (transport/local): memcpy on
//                     worker threads
//   GPU  -> GPU       DeviceMemory::Engine of the destination's GPU: the
//                     cuda_ipc kernels, over NVLink between GPUs
//   host <-> GPU      the same, with the host side pinned (fallback staging
//                     of GPU ranks always is; a client's host region is
//                     pinned once, the first time a copy needs it) and read
//                     or written by the kernels over PCIe; on the source's
//                     GPU when the destination is host memory
//
// Used for every same-node copy: the LocalExecutor's, and the parts of a
// transfer between nodes that stay on one node (route_memory.h,
// CopyViews).
// Threading: thread-safe; a Batch belongs to one caller.
#ifndef FERRY_DAEMON_TRANSFER_COPY_ROUTER_H_
#define FERRY_DAEMON_TRANSFER_COPY_ROUTER_H_

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/memory/memory_map.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace ferry {

// Where a buffer is: its first byte, and whether a GPU can address it.
struct BufferPlace {
  uint8_t* base = nullptr;  // null: not mapped here
  int gpu = -1;             // >= 0: device memory of that GPU
  bool pinned = false;      // host memory the GPUs' kernels can address
  // A client's region (null for staging): where to pin it if needed.
  const MemoryMap* map = nullptr;
  size_t index = 0;

  bool on_gpu() const { return gpu >= 0; }
};

// The place of region `index` of a client's map (base null when absent).
BufferPlace PlaceIn(const MemoryMap& memory, size_t index);

// "GPU memory" / "host memory", for messages.
const char* KindOf(const BufferPlace& place);

class CopyRouter {
 public:
  // Copies grouped by the engine that runs them: host, or one per GPU.
  class Batch {
   public:
    void Add(CopyEngine* engine, LocalCopy copy);
    void Clear();

   private:
    friend class CopyRouter;
    std::vector<std::pair<CopyEngine*, std::vector<LocalCopy>>> groups_;
  };

  // Neither is owned; `devices` may be null or unavailable (no GPUs).
  CopyRouter(CopyEngine* host_engine, DeviceMemory* devices);

  // The engine for a copy from `src` to `dst`, pinning a host side first
  // when the other is on a GPU (marks it pinned). UNIMPLEMENTED saying why
  // when the host side cannot be pinned (staging that is not pinned, or
  // the driver refused).
  absl::StatusOr<CopyEngine*> EngineFor(BufferPlace& src,
                                        BufferPlace& dst) const;

  // Runs every group, the engines at once; the first error.
  absl::Status Run(Batch& batch) const;

 private:
  CopyEngine* const host_engine_;
  DeviceMemory* const devices_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_COPY_ROUTER_H_
