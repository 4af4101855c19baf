// QuantizeBlocksOnGpu: core/fp8_blocks.h's QuantizeBlocks on device
// memory, the same bytes and scales (tests/gpu/gpu_fp8_test.cc checks
// both against one oracle where a GPU is lent).
#ifndef FERRY_CUDA_KERNELS_FP8_BLOCK_QUANTIZER_H_
#define FERRY_CUDA_KERNELS_FP8_BLOCK_QUANTIZER_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"
#include "core/fp8_blocks.h"

namespace ferry {
namespace gpu {

// Enqueues the quantization of `src` into `out` and `scale_inv` (device
// pointers, laid out as QuantizeBlocks lays them out) on `stream`.
// INVALID_ARGUMENT as QuantizeBlocks; a CUDA error naming the launch.
absl::Status QuantizeBlocksOnGpu(const void* src, DType src_dtype,
                                 const Fp8BlockShape& shape, DType fp8,
                                 uint8_t* out, float* scale_inv,
                                 cudaStream_t stream);

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_KERNELS_FP8_BLOCK_QUANTIZER_H_
