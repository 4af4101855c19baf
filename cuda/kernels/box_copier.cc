#include "cuda/kernels/box_copier.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda/cuda_status.h"
#include "cuda/device.h"

namespace ferry {
namespace gpu {
namespace {

// Plans in flight at once per copier before Launch waits.
constexpr int kRingSize = 4;
// Blocks per SM: 8 x 256 threads fills an SM (2048 threads).
constexpr int kBlocksPerSm = 8;

}  // namespace

struct BoxCopier::Buffer {
  BoxCopyDesc* device = nullptr;
  BoxCopyDesc* host = nullptr;  // pinned
  size_t capacity = 0;          // descriptors
  cudaEvent_t uploaded = nullptr;
  bool recorded = false;  // `uploaded` was recorded since the last wait

  void Free() {
    if (device != nullptr) (void)cudaFree(device);
    if (host != nullptr) (void)cudaFreeHost(host);
    device = nullptr;
    host = nullptr;
    capacity = 0;
  }
};

absl::Status PollEvent(void* event, absl::Time deadline,
                       absl::string_view what) {
  const absl::Time spin_until = absl::Now() + absl::Microseconds(200);
  while (true) {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess) return absl::OkStatus();
    if (e != cudaErrorNotReady) {
      return CudaStatus(e, absl::StrCat("cudaEventQuery(", what, ")"));
    }
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": not complete by the deadline"));
    }
    if (now < spin_until) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(20));
    }
  }
}

absl::StatusOr<std::unique_ptr<BoxCopier>> BoxCopier::Create(int device) {
  if (absl::Status s = UseDevice(device); !s.ok()) return s;
  int sms = 0;
  FERRY_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  std::unique_ptr<BoxCopier> copier(
      new BoxCopier(device, std::max(1, sms) * kBlocksPerSm));
  for (int i = 0; i < kRingSize; ++i) {
    FERRY_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(
        &copier->ring_[i].uploaded, cudaEventDisableTiming));
  }
  return copier;
}

BoxCopier::BoxCopier(int device, int max_blocks)
    : device_(device),
      max_blocks_(max_blocks),
      ring_(new Buffer[kRingSize]) {}

BoxCopier::~BoxCopier() {
  for (int i = 0; i < kRingSize; ++i) {
    Buffer& b = ring_[i];
    // A stream stuck behind a hung NCCL kernel must not hang the owner:
    // wait a bounded time, then leak the buffers rather than free them
    // under a pending upload.
    if (b.recorded && !PollEvent(b.uploaded, absl::Now() + absl::Seconds(10),
                                 "descriptor upload at close")
                           .ok()) {
      continue;
    }
    b.Free();
    if (b.uploaded != nullptr) (void)cudaEventDestroy(b.uploaded);
  }
}

absl::Status BoxCopier::Launch(const BoxCopyPlan& plan, void* stream,
                               absl::Time deadline) {
  if (plan.empty()) return absl::OkStatus();
  Buffer& b = ring_[next_];
  next_ = (next_ + 1) % kRingSize;
  // The pinned array is reused only after its previous upload finished.
  if (b.recorded) {
    if (absl::Status s = PollEvent(b.uploaded, deadline,
                                   "box copy descriptor upload");
        !s.ok()) {
      return s;
    }
    b.recorded = false;
  }
  const size_t n = plan.descs().size();
  if (n > b.capacity) {
    b.Free();
    const size_t capacity = std::max<size_t>(64, n + n / 2);
    FERRY_CUDA_RETURN_IF_ERROR(
        cudaMalloc(&b.device, capacity * sizeof(BoxCopyDesc)));
    FERRY_CUDA_RETURN_IF_ERROR(
        cudaHostAlloc(&b.host, capacity * sizeof(BoxCopyDesc),
                      cudaHostAllocDefault));
    b.capacity = capacity;
  }
  std::memcpy(b.host, plan.descs().data(), n * sizeof(BoxCopyDesc));
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  FERRY_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(
      b.device, b.host, n * sizeof(BoxCopyDesc), cudaMemcpyHostToDevice, s));
  FERRY_CUDA_RETURN_IF_ERROR(cudaEventRecord(b.uploaded, s));
  b.recorded = true;
  return CudaStatus(
      static_cast<cudaError_t>(LaunchBoxCopyKernel(
          b.device, static_cast<int32_t>(n), plan.total_tiles(), max_blocks_,
          stream)),
      absl::StrCat("box copy kernel launch (", n, " boxes, ",
                   plan.total_tiles(), " tiles)"));
}

}  // namespace gpu
}  // namespace ferry
