// OpenNodeGpus: the DeviceMemory ferryd runs with.
//
// One declaration, two definitions, chosen by the build: with CUDA
// (cuda/node_gpus_cuda.cc) the node's GPUs when a driver and a GPU are
// there; without (daemon/node_gpus_host_only.cc) always unavailable. Either
// way a machine without GPUs gets UnavailableDeviceMemory with the reason,
// and ferryd runs on the host backends.
#ifndef FERRY_DAEMON_NODE_GPUS_H_
#define FERRY_DAEMON_NODE_GPUS_H_

#include <memory>

#include "daemon/device_memory.h"

namespace ferry {

// `enabled` false (ferryd --gpus=false): unavailable, "disabled".
std::unique_ptr<DeviceMemory> OpenNodeGpus(bool enabled);

}  // namespace ferry

#endif  // FERRY_DAEMON_NODE_GPUS_H_
