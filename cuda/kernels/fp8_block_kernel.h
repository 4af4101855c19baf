// The FP8 block quantization kernel's launcher (fp8_block_kernel.cu),
// plain C++ so that callers need no CUDA headers. Use
// QuantizeBlocksOnGpu (fp8_block_quantizer.h); this is its back end.
#ifndef FERRY_CUDA_KERNELS_FP8_BLOCK_KERNEL_H_
#define FERRY_CUDA_KERNELS_FP8_BLOCK_KERNEL_H_

#include <cstdint>

namespace ferry {
namespace gpu {

enum Fp8SourceKind { kFp8SourceF32 = 0, kFp8SourceF16 = 1, kFp8SourceBF16 = 2 };

// Enqueues the kernel on `stream` (a cudaStream_t); device pointers. The
// cudaError_t of the launch.
int LaunchFp8BlockKernel(const void* src, int src_kind, int64_t rows,
                         int64_t cols, int64_t block_rows, int64_t block_cols,
                         int e5m2, uint8_t* out, float* scale_inv,
                         void* stream);

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_KERNELS_FP8_BLOCK_KERNEL_H_
