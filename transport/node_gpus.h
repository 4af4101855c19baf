// OpenNodeGpus: the DeviceMemory ferryd runs with.
//
// One declaration, two definitions, chosen by the build: with CUDA
// (cuda/node_gpus_cuda.cc) the node's GPUs when a driver and a GPU are
// there; without (transport/node_gpus_host_only.cc) always unavailable. Either
// way a machine without GPUs gets UnavailableDeviceMemory with the reason,
// and ferryd runs on the host backends.
#ifndef FERRY_TRANSPORT_NODE_GPUS_H_
#define FERRY_TRANSPORT_NODE_GPUS_H_

#include <cstdint>
#include <memory>

#include "transport/device_memory.h"

namespace ferry {

struct NodeGpuOptions {
  // False (ferryd --gpus=false): unavailable, "disabled".
  bool enabled = true;
  // Each of the two device staging slots of an NCCL channel to another
  // daemon (cuda/nccl/nccl_channel.h); a bucket larger than this moves in
  // chunks, double-buffered.
  int64_t channel_staging_bytes = int64_t{64} << 20;
};

std::unique_ptr<DeviceMemory> OpenNodeGpus(const NodeGpuOptions& options);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_NODE_GPUS_H_
