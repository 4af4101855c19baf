// HostBackedGpus: a DeviceMemory (transport/device_memory.h) whose "GPUs" are
// host shared memory, so that the daemon's GPU wiring (registration of
// CUDA IPC regions, one open per allocation, the choice of copy engine per
// box, pinned staging, refusing host <-> GPU copies) is tested on machines
// without a GPU. The real implementation, cuda/gpu_device_memory.h, runs
// in tests/gpu on a GPU machine (tests/gpu/device_check.sh).
//
// A "CUDA IPC handle" here is the name of a POSIX shared memory object,
// NUL-padded to 64 bytes (FakeGpuRegion builds such regions). Each GPU's
// engine is a host copy engine that counts what it copied. The "NCCL
// fabric" between daemons is a loopback TCP channel: JoinFabric of rank 1
// listens and publishes its port under the id, rank 0 connects to it (a
// rendezvous inside this process, where the test's daemons all run), so
// ferryd's NCCL route (OpenChannel with an NCCL setup, both sides joining,
// views of GPU memory, pinning) runs end to end without NCCL.
#ifndef FERRY_TESTS_DAEMON_HOST_BACKED_GPUS_H_
#define FERRY_TESTS_DAEMON_HOST_BACKED_GPUS_H_

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "proto/ferry/v1/types.pb.h"
#include "transport/device_memory.h"
#include "transport/shared_memory.h"

namespace ferry {
namespace testing {

// A cuda_ipc MemoryRegion naming `memory` as an allocation on GPU `uuid`.
v1::MemoryRegion FakeGpuRegion(uint32_t id, const SharedMemoryRegion& memory,
                               const std::string& uuid);

// What the fake saw, readable while the daemon runs.
struct GpuCounters {
  std::atomic<int64_t> opens{0};    // allocations opened
  std::atomic<int64_t> closes{0};   // allocations closed
  std::atomic<int64_t> pins{0};     // PinHost calls
  std::atomic<int64_t> read_only_pins{0};
  std::atomic<int64_t> unpins{0};
  // PinHost succeeds this many more times, then fails (-1: always works).
  std::atomic<int64_t> pin_budget{-1};
  std::atomic<int64_t> bytes_by_gpu[2] = {{0}, {0}};  // copied by its engine
  std::atomic<int64_t> fabric_joins{0};
  // GPU memory the daemon allocated (AllocateExported: device staging)
  // and freed; allocations succeed this many more times (-1: always).
  std::atomic<int64_t> allocations{0};
  std::atomic<int64_t> frees{0};
  std::atomic<int64_t> allocation_budget{-1};  // JoinFabric calls that succeeded
  // Engine copies in progress now, and the most there were at once (over
  // both GPUs). With copies_to_meet > 1 each copy first waits, at most a
  // second, until that many are in progress at once: a copy that runs
  // alone can then not finish before another starts, so max_copies_at_once
  // says whether the daemon ran them side by side.
  std::atomic<int> copies_at_once{0};
  std::atomic<int> max_copies_at_once{0};
  std::atomic<int> copies_to_meet{0};
};

// Two GPUs, "GPU-fake-0" and "GPU-fake-1". `counters` must outlive it.
std::unique_ptr<DeviceMemory> HostBackedGpus(GpuCounters* counters);

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_DAEMON_HOST_BACKED_GPUS_H_
