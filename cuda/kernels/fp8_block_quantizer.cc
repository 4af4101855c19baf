#include "cuda/kernels/fp8_block_quantizer.h"

#include "absl/strings/str_cat.h"
#include "cuda/cuda_status.h"
#include "cuda/kernels/fp8_block_kernel.h"

namespace ferry {
namespace gpu {

absl::Status QuantizeBlocksOnGpu(const void* src, DType src_dtype,
                                 const Fp8BlockShape& shape, DType fp8,
                                 uint8_t* out, float* scale_inv,
                                 cudaStream_t stream) {
  // The checks are the CPU routine's: the same shapes and dtypes pass.
  if (absl::Status s = CheckFp8BlockArguments(src_dtype, shape, fp8); !s.ok()) {
    return s;
  }
  if (shape.block_grid_cols() > 0x7fffffff || shape.block_grid_rows() > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 block quantization on the GPU: a grid of ", shape.block_grid_rows(),
        " x ", shape.block_grid_cols(), " blocks is more than one launch takes"));
  }
  const int kind = src_dtype == DType::kF32   ? kFp8SourceF32
                   : src_dtype == DType::kF16 ? kFp8SourceF16
                                              : kFp8SourceBF16;
  return CudaStatus(
      static_cast<cudaError_t>(LaunchFp8BlockKernel(
          src, kind, shape.rows, shape.cols, shape.block_rows,
          shape.block_cols, fp8 == DType::kF8E5M2 ? 1 : 0, out, scale_inv,
          stream)),
      "Fp8BlockKernel launch");
}

}  // namespace gpu
}  // namespace ferry
