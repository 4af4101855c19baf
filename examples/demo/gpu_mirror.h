// GpuMirror: a demo rank's tensors in GPU memory (--device=cuda:N).
//
// The demo ranks compute and check bytes on the CPU, in their host arena.
// With --device=cuda:N the arena becomes the host side of a mirror: the
// trainer fills it and uploads it to the GPU buffer it registered before
// each version; the engine uploads its base weights once, and downloads
// the GPU buffer before checking it. ferryd only ever sees the GPU buffer
// (a CUDA IPC region), so the transfer being measured is GPU to GPU.
//
// Built with CUDA: gpu_mirror_cuda.cc. Without: gpu_mirror_none.cc, where
// Create says so.
#ifndef FERRY_EXAMPLES_DEMO_GPU_MIRROR_H_
#define FERRY_EXAMPLES_DEMO_GPU_MIRROR_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

class GpuMirror {
 public:
  // `device` is "cuda:N". INVALID_ARGUMENT for another spelling,
  // UNIMPLEMENTED when the demo was built without CUDA, UNAVAILABLE (not
  // viable) without a GPU, the CUDA error when `bytes` cannot be allocated.
  static absl::StatusOr<std::unique_ptr<GpuMirror>> Create(
      const std::string& device, int64_t bytes);
  virtual ~GpuMirror() = default;

  // The whole buffer from / to host memory of the same size.
  virtual absl::Status Upload(const uint8_t* host) = 0;
  virtual absl::Status Download(uint8_t* host) = 0;
  // The buffer as a CUDA IPC region to register.
  virtual v1::MemoryRegion Describe(uint32_t region_id) const = 0;
};

}  // namespace ferry

#endif  // FERRY_EXAMPLES_DEMO_GPU_MIRROR_H_
