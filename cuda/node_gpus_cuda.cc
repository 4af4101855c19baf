// OpenNodeGpus for a ferryd built with CUDA (transport/node_gpus.h).
#include "absl/strings/str_cat.h"
#include "cuda/gpu_device_memory.h"
#include "glog/logging.h"
#include "transport/node_gpus.h"

namespace ferry {

std::unique_ptr<DeviceMemory> OpenNodeGpus(const NodeGpuOptions& options) {
  if (!options.enabled) {
    return UnavailableDeviceMemory("GPUs are disabled (ferryd --gpus=false)");
  }
  gpu::GpuDeviceMemoryOptions gpu_options;
  gpu_options.fabric_staging_bytes = options.channel_staging_bytes;
  absl::StatusOr<std::unique_ptr<DeviceMemory>> gpus =
      gpu::CreateGpuDeviceMemory(gpu_options);
  if (gpus.ok()) return *std::move(gpus);
  LOG(INFO) << "no GPU data path, host memory only: " << gpus.status().message();
  return UnavailableDeviceMemory(
      absl::StrCat("no usable GPU here (", gpus.status().message(), ")"));
}

}  // namespace ferry
