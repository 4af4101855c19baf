// Launching box copy plans (box_copy_plan.h) on a CUDA stream.
//
// A BoxCopier owns the device array the kernel reads its descriptors from,
// a pinned host array they are staged in, and a small ring of both so that
// plan k+1 can be uploaded while plan k's kernel still runs. One launch
// copies a whole batch (a bucket's worth of boxes, or one staging chunk of
// it) whatever the boxes' ranks and unit sizes.
//
// No CUDA type appears here: a stream is passed as `void*` (a
// cudaStream_t; nullptr is the legacy default stream).
//
// Lifetime and threading: not thread-safe; one owner (typically one per
// stream). Bound to one device, which must be current on the calling
// thread (gpu::UseDevice) for every call. Destruction waits for the
// copier's own uploads; the caller must not destroy it while a launched
// kernel may still read descriptors (synchronize the stream first).
#ifndef FERRY_CUDA_KERNELS_BOX_COPIER_H_
#define FERRY_CUDA_KERNELS_BOX_COPIER_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "cuda/kernels/box_copy_plan.h"

namespace ferry {
namespace gpu {

class BoxCopier {
 public:
  // NotViable without a GPU; otherwise a copier for `device`.
  static absl::StatusOr<std::unique_ptr<BoxCopier>> Create(int device);

  BoxCopier(const BoxCopier&) = delete;
  BoxCopier& operator=(const BoxCopier&) = delete;
  ~BoxCopier();

  // Enqueues the plan's copies on `stream` and returns; they run in stream
  // order. Waits (polling, at most until `deadline`) only when every
  // descriptor buffer of the ring still feeds an earlier launch.
  // DEADLINE_EXCEEDED then; a CUDA error otherwise.
  absl::Status Launch(const BoxCopyPlan& plan, void* stream,
                      absl::Time deadline = absl::InfiniteFuture());

  int device() const { return device_; }

 private:
  struct Buffer;
  BoxCopier(int device, int max_blocks);

  int device_;
  int max_blocks_;
  int next_ = 0;
  std::unique_ptr<Buffer[]> ring_;
};

// Polls `event` (a cudaEvent_t) until it completes, `deadline` passes
// (DEADLINE_EXCEEDED naming `what`) or CUDA reports an error. Spins
// briefly, then sleeps in short steps: never blocks in the driver.
absl::Status PollEvent(void* event, absl::Time deadline,
                       absl::string_view what);

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_KERNELS_BOX_COPIER_H_
