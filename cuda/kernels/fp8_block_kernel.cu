// FP8 block quantization on the GPU: core/fp8_blocks.h's rule (DeepGEMM's
// per_block_cast_to_fp8), one thread block per block of the tensor. The
// same bytes as the CPU routine: amax is a max (exact in any order),
// 448 / amax and amax / 448 are IEEE divisions (nvcc's default
// -prec-div=true; no fast math), x * scale one rounded multiply, and the
// conversion PTX's cvt.rn.satfinite (nearest even, saturating).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/kernels/fp8_block_kernel.h"

namespace ferry {
namespace gpu {
namespace {

constexpr int kThreads = 256;

__device__ float LoadElement(const void* src, int src_kind, int64_t i) {
  switch (src_kind) {
    case kFp8SourceF32:
      return static_cast<const float*>(src)[i];
    case kFp8SourceF16:
      return __half2float(static_cast<const __half*>(src)[i]);
    default:
      return __bfloat162float(static_cast<const __nv_bfloat16*>(src)[i]);
  }
}

__global__ void __launch_bounds__(kThreads)
    Fp8BlockKernel(const void* __restrict__ src, int src_kind, int64_t rows,
                   int64_t cols, int64_t block_rows, int64_t block_cols,
                   int e5m2, uint8_t* __restrict__ out,
                   float* __restrict__ scale_inv) {
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * block_rows;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * block_cols;
  const int64_t h = min(block_rows, rows - r0);
  const int64_t w = min(block_cols, cols - c0);
  const int64_t n = h * w;

  float amax = 0.0f;
  bool nan = false;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    const float a = fabsf(LoadElement(src, src_kind, (r0 + k / w) * cols + c0 + k % w));
    nan = nan || isnan(a);
    amax = fmaxf(amax, a);
  }
  __shared__ float maxes[kThreads];
  __shared__ int nans[kThreads];
  maxes[threadIdx.x] = amax;
  nans[threadIdx.x] = nan ? 1 : 0;
  __syncthreads();
  for (int s = kThreads / 2; s > 0; s /= 2) {
    if (threadIdx.x < s) {
      maxes[threadIdx.x] = fmaxf(maxes[threadIdx.x], maxes[threadIdx.x + s]);
      nans[threadIdx.x] |= nans[threadIdx.x + s];
    }
    __syncthreads();
  }
  const float max = e5m2 ? 57344.0f : 448.0f;
  float block_amax = nans[0] ? __int_as_float(0x7fffffff) : fmaxf(maxes[0], 1e-4f);
  const float scale = __fdiv_rn(max, block_amax);
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x) {
    const int64_t i = (r0 + k / w) * cols + c0 + k % w;
    const float v = __fmul_rn(LoadElement(src, src_kind, i), scale);
    out[i] = static_cast<uint8_t>(
        __nv_cvt_float_to_fp8(v, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3));
  }
  if (threadIdx.x == 0) {
    scale_inv[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] =
        __fdiv_rn(block_amax, max);
  }
}

}  // namespace

int LaunchFp8BlockKernel(const void* src, int src_kind, int64_t rows,
                         int64_t cols, int64_t block_rows, int64_t block_cols,
                         int e5m2, uint8_t* out, float* scale_inv,
                         void* stream) {
  if (rows <= 0 || cols <= 0) return static_cast<int>(cudaSuccess);
  const dim3 grid(static_cast<unsigned>((cols + block_cols - 1) / block_cols),
                  static_cast<unsigned>((rows + block_rows - 1) / block_rows));
  Fp8BlockKernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      src, src_kind, rows, cols, block_rows, block_cols, e5m2, out, scale_inv);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gpu
}  // namespace ferry
