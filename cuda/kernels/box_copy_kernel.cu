// The batched strided box copy kernel: pack, unpack and region-to-region
// copies are all this one kernel with different descriptors (see
// box_copy_desc.h). Kept to one small translation unit: nvcc is slow.
#include <cuda_runtime.h>

#include "cuda/kernels/box_copy_desc.h"

namespace ferry {
namespace gpu {
namespace {

__global__ void __launch_bounds__(kThreadsPerBlock)
    BoxCopyKernel(const BoxCopyDesc* __restrict__ descs, int32_t n,
                  int64_t total_tiles) {
  // Raw storage: BoxCopyDesc has default member initializers, and a
  // __shared__ object must not be constructed by every thread.
  __shared__ alignas(16) unsigned char desc_storage[sizeof(BoxCopyDesc)];
  __shared__ int64_t first_tile;
  BoxCopyDesc& desc = *reinterpret_cast<BoxCopyDesc*>(desc_storage);
  int32_t box = -1;
  for (int64_t tile = blockIdx.x; tile < total_tiles; tile += gridDim.x) {
    // Grid-stride tiles are increasing, so a block usually stays in its
    // box; search only when it leaves it.
    if (threadIdx.x == 0) {
      if (box < 0 || tile >= first_tile + desc.tiles) {
        box = FindBox(descs, n, tile);
        desc = descs[box];
        first_tile = desc.first_tile;
      }
    }
    __syncthreads();
    CopyTileAnyWord(desc, tile - first_tile, threadIdx.x, blockDim.x);
    __syncthreads();  // before thread 0 may overwrite `desc`
  }
}

}  // namespace

int LaunchBoxCopyKernel(const BoxCopyDesc* descs, int32_t n,
                        int64_t total_tiles, int max_blocks, void* stream) {
  if (n <= 0 || total_tiles <= 0) return static_cast<int>(cudaSuccess);
  const int64_t blocks = total_tiles < max_blocks ? total_tiles : max_blocks;
  BoxCopyKernel<<<static_cast<unsigned>(blocks), kThreadsPerBlock, 0,
                  static_cast<cudaStream_t>(stream)>>>(descs, n, total_tiles);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gpu
}  // namespace ferry
