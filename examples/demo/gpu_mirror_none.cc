// GpuMirror without CUDA (gpu_mirror.h).
#include "examples/demo/gpu_mirror.h"

namespace ferry {

absl::StatusOr<std::unique_ptr<GpuMirror>> GpuMirror::Create(
    const std::string& device, int64_t) {
  return absl::UnimplementedError(
      "--device=" + device +
      ": this demo was built without CUDA; use --device=host");
}

}  // namespace ferry
