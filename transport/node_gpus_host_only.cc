// OpenNodeGpus for a ferryd built without CUDA (transport/node_gpus.h).
#include "transport/node_gpus.h"

namespace ferry {

std::unique_ptr<DeviceMemory> OpenNodeGpus(const NodeGpuOptions& options) {
  return UnavailableDeviceMemory(
      options.enabled ? "this ferryd was built without CUDA (host memory only)"
              : "GPUs are disabled (ferryd --gpus=false)");
}

}  // namespace ferry
