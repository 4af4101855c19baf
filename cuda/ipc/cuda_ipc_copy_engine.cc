#include "cuda/ipc/cuda_ipc_copy_engine.h"

#include <cuda_runtime_api.h>
#include <glog/logging.h>

#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "cuda/cuda_status.h"
#include "cuda/device.h"
#include "cuda/kernels/box_copier.h"
#include "cuda/kernels/box_copy_plan.h"

namespace ferry {
namespace {

using gpu::BoxCopier;
using gpu::BoxCopyPlan;

// What one Run uses exclusively: a stream, the copier that launches on it
// and the event that says the launch is done.
struct Lane {
  cudaStream_t stream = nullptr;
  cudaEvent_t done = nullptr;
  std::unique_ptr<BoxCopier> copier;

  Lane() = default;
  Lane(const Lane&) = delete;
  Lane& operator=(const Lane&) = delete;
  ~Lane() {
    copier.reset();
    if (done != nullptr) (void)cudaEventDestroy(done);
    if (stream != nullptr) (void)cudaStreamDestroy(stream);
  }
};

class CudaIpcCopyEngine final : public CopyEngine {
 public:
  explicit CudaIpcCopyEngine(const CudaIpcCopyEngineOptions& options)
      : options_(options) {}

  std::string name() const override {
    return absl::StrCat("cuda_ipc(device ", options_.device, ")");
  }

  absl::Status Run(const std::vector<LocalCopy>& copies) override {
    const absl::Time deadline = absl::Now() + options_.timeout;
    // Validate and plan everything before any byte moves.
    BoxCopyPlan plan;
    for (size_t i = 0; i < copies.size(); ++i) {
      if (absl::Status s = plan.Add(copies[i], absl::StrCat("copy ", i));
          !s.ok()) {
        return s;
      }
    }
    if (plan.empty()) return absl::OkStatus();
    if (absl::Status s = gpu::UseDevice(options_.device); !s.ok()) return s;
    absl::StatusOr<std::unique_ptr<Lane>> lane = TakeLane();
    if (!lane.ok()) return lane.status();
    absl::Status s = (*lane)->copier->Launch(plan, (*lane)->stream, deadline);
    if (s.ok()) {
      s = gpu::CudaStatus(cudaEventRecord((*lane)->done, (*lane)->stream),
                          "cudaEventRecord");
    }
    if (s.ok()) s = gpu::PollEvent((*lane)->done, deadline, name());
    if (absl::IsDeadlineExceeded(s)) {
      // The kernel may still be running: its lane cannot be reused or
      // freed (freeing would wait on it). Leak it; the GPU is in trouble.
      LOG(ERROR) << name() << ": a copy of " << plan.bytes()
                 << " bytes did not finish in " << options_.timeout;
      (void)lane->release();
      return s;
    }
    GiveBackLane(*std::move(lane));
    return s;
  }

 private:
  absl::StatusOr<std::unique_ptr<Lane>> TakeLane() {
    {
      absl::MutexLock lock(&mu_);
      if (!idle_.empty()) {
        std::unique_ptr<Lane> lane = std::move(idle_.back());
        idle_.pop_back();
        return lane;
      }
    }
    auto lane = std::make_unique<Lane>();
    FERRY_CUDA_RETURN_IF_ERROR(
        cudaStreamCreateWithFlags(&lane->stream, cudaStreamNonBlocking));
    FERRY_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&lane->done, cudaEventDisableTiming));
    absl::StatusOr<std::unique_ptr<BoxCopier>> copier =
        BoxCopier::Create(options_.device);
    if (!copier.ok()) return copier.status();
    lane->copier = *std::move(copier);
    return lane;
  }

  void GiveBackLane(std::unique_ptr<Lane> lane) {
    absl::MutexLock lock(&mu_);
    idle_.push_back(std::move(lane));
  }

  const CudaIpcCopyEngineOptions options_;
  absl::Mutex mu_;
  // Lanes not in a Run. As many exist as Runs ever overlapped.
  std::vector<std::unique_ptr<Lane>> idle_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<CopyEngine>> CreateCudaIpcCopyEngine(
    const CudaIpcCopyEngineOptions& options) {
  if (absl::Status s = gpu::IsViable(); !s.ok()) return s;
  if (absl::Status s = gpu::UseDevice(options.device); !s.ok()) return s;
  return std::unique_ptr<CopyEngine>(new CudaIpcCopyEngine(options));
}

}  // namespace ferry
