// The transport conformance suite (tests/transport/transport_conformance.h)
// against the GPU backends, on GPU 0: the cuda_ipc CopyEngine, and the NCCL
// channel as a loopback pair on a one-rank communicator (the receiver
// issues the grouped self send/recv). The buckets' buffers are device
// memory (DeviceTestMemory); the oracle checks them on the host. Every case
// skips, saying why, without a GPU.
#include <memory>

#include "cuda/ipc/cuda_ipc_copy_engine.h"
#include "cuda/nccl/nccl_channel.h"
#include "cuda/nccl/nccl_communicator.h"
#include "tests/gpu/device_buffers.h"

namespace ferry {
namespace {

std::unique_ptr<CopyEngine> CudaIpcEngine() {
  absl::StatusOr<std::unique_ptr<CopyEngine>> e = CreateCudaIpcCopyEngine();
  INFO(e.status().ToString());
  REQUIRE(e.ok());
  return *std::move(e);
}

// A sender and a receiver channel on one one-rank communicator.
testing::ChannelPair NcclLoopbackPair() {
  absl::StatusOr<std::string> id = gpu::NewNcclUniqueId();
  INFO(id.status().ToString());
  REQUIRE(id.ok());
  gpu::NcclCommunicatorOptions options;
  options.unique_id = *id;
  absl::StatusOr<std::unique_ptr<gpu::NcclCommunicator>> comm =
      gpu::NcclCommunicator::Create(options, testing::TestDeadline());
  INFO(comm.status().ToString());
  REQUIRE(comm.ok());
  std::shared_ptr<gpu::NcclCommunicator> shared = *std::move(comm);
  NcclChannelOptions channel;
  channel.peer = 0;
  channel.staging_bytes = 4 << 20;
  testing::ChannelPair pair;
  for (std::unique_ptr<Channel>* c : {&pair.sender, &pair.receiver}) {
    absl::StatusOr<std::unique_ptr<Channel>> ch =
        CreateNcclChannel(shared.get(), channel);
    INFO(ch.status().ToString());
    REQUIRE(ch.ok());
    *c = *std::move(ch);
  }
  pair.keep_alive = shared;
  return pair;
}

}  // namespace

FERRY_COPY_ENGINE_CONFORMANCE_TESTS_IN("cuda_ipc", CudaIpcEngine,
                                       gpu_testing::DeviceMemoryForTests())
FERRY_CHANNEL_CONFORMANCE_TESTS_IN("nccl loopback", NcclLoopbackPair,
                                   gpu_testing::DeviceMemoryForTests())

}  // namespace ferry
