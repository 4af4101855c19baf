// Host side of the box copy kernel: turns box copies (transport.h's
// LocalCopy, whose addresses are device addresses here) into the kernel's
// descriptors (box_copy_desc.h).
//
// Each box is coalesced first, as core/region_copy.cc does on the host:
// dims of extent 1 are dropped, the innermost dims that are contiguous on
// both sides fold into one run, and outer dims that step uniformly on both
// sides merge. A row shard of a row-major matrix thus becomes one run per
// row, a whole tensor one run. Then the widest word that divides both
// addresses, every stride and the run is chosen, and the box is cut into
// tiles. Packing and unpacking are copies too: one side is staging,
// contiguous row-major, so they share the kernel.
//
// The plan also runs on the host (RunPlanOnHost) with the kernel's own tile
// loop: the CPU check of the device code, used by tests on any machine.
//
// Threading: a plan is a value; not thread-safe.
#ifndef FERRY_CUDA_KERNELS_BOX_COPY_PLAN_H_
#define FERRY_CUDA_KERNELS_BOX_COPY_PLAN_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "cuda/kernels/box_copy_desc.h"
#include "transport/bucket_segments.h"
#include "transport/transport.h"

namespace ferry {
namespace gpu {

class BoxCopyPlan {
 public:
  // Appends a copy. INVALID_ARGUMENT naming `what` when it is malformed
  // (ranks differ, negative extent, unit_bytes <= 0, no base). A box that
  // keeps more than kMaxOuterDims strided dims after coalescing becomes one
  // descriptor per index of its outermost dim. Empty boxes add nothing. On
  // error the plan is unchanged.
  absl::Status Add(const LocalCopy& copy, absl::string_view what);

  // Appends the copies between segments [first, last) of `bucket` (see
  // bucket_segments.h) and `staging`, which holds exactly those segments'
  // bytes, contiguous, from segments[first]. `pack`: regions -> staging;
  // otherwise staging -> regions. REQUIRES: ValidateBucketView(bucket) ok,
  // first <= last <= segments.size().
  absl::Status AddSegments(const BucketView& bucket,
                           const std::vector<PackedSegment>& segments,
                           size_t first, size_t last, uint8_t* staging,
                           bool pack);

  void Clear();
  bool empty() const { return descs_.empty(); }
  const std::vector<BoxCopyDesc>& descs() const { return descs_; }
  int64_t total_tiles() const { return total_tiles_; }
  int64_t bytes() const { return bytes_; }

 private:
  // One coalesced copy: `inner_bytes` contiguous, repeated over the outer
  // dims `oe` with strides `os` / `od` in units of `unit_bytes`.
  void AddCoalesced(uint64_t src, uint64_t dst, int64_t inner_bytes,
                    int64_t unit_bytes, const Dims& oe, const Dims& os,
                    const Dims& od);

  std::vector<BoxCopyDesc> descs_;
  int64_t total_tiles_ = 0;
  int64_t bytes_ = 0;
};

// Copies every tile of `plan` on the calling thread, emulating `threads`
// threads per tile with the kernel's loop. The addresses must be host
// memory.
void RunPlanOnHost(const BoxCopyPlan& plan, int threads = kThreadsPerBlock);

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_KERNELS_BOX_COPY_PLAN_H_
