// The strided box copy as the kernel sees it: one descriptor per box, and
// the per-tile copy loop, compiled both by nvcc (the kernel) and by the
// host compiler (box_copy_plan's CPU interpreter, which tests the very same
// loop on machines without a GPU).
//
// A box copy is, after the host has coalesced it (box_copy_plan.h), a
// contiguous run of `inner_words` words repeated over up to kMaxOuterDims
// outer dims with byte strides on each side. The word is the widest of 16,
// 8, 4, 2 or 1 bytes that divides both addresses, every stride and the run
// length, so bf16 rows move as 16-byte vectors and 18-byte GGUF blocks as
// 2-byte words (or bytes, when misaligned): one kernel covers every unit
// size. Work is cut into tiles of about kTileBytes: a tile is part of one
// run (long runs), or several whole runs (short runs). A launch covers a
// whole batch: descriptors sit in a device array in tile order, and each
// block finds its box by binary search on `first_tile`.
//
// Plain C++ (no CUDA types), so it can be included anywhere.
#ifndef FERRY_CUDA_KERNELS_BOX_COPY_DESC_H_
#define FERRY_CUDA_KERNELS_BOX_COPY_DESC_H_

#include <cstdint>

#if defined(__CUDACC__)
#define FERRY_HOST_DEVICE __host__ __device__
#define FERRY_FORCE_INLINE __forceinline__
#else
#define FERRY_HOST_DEVICE
#define FERRY_FORCE_INLINE inline
#endif

namespace ferry {
namespace gpu {

// Outer dims after coalescing; with the contiguous run that makes 8.
constexpr int kMaxOuterDims = 7;
constexpr int kThreadsPerBlock = 256;
constexpr int64_t kTileBytes = 64 << 10;

struct BoxCopyDesc {
  uint64_t src = 0;  // address of the box's first byte
  uint64_t dst = 0;
  int64_t first_tile = 0;  // tile index of this box within the launch
  int64_t tiles = 0;
  int64_t rows = 0;         // product of the outer extents
  int64_t inner_words = 0;  // words per contiguous run
  int64_t rows_per_tile = 1;
  int64_t cols_per_tile = 0;  // words
  int64_t col_tiles = 1;      // tiles per run (1 when rows_per_tile > 1)
  int32_t word_bytes = 1;     // 1, 2, 4, 8 or 16
  int32_t outer_rank = 0;
  int64_t extent[kMaxOuterDims] = {};
  int64_t src_stride[kMaxOuterDims] = {};  // bytes
  int64_t dst_stride[kMaxOuterDims] = {};
};

// A 16-byte word the compilers move as one vector load/store.
struct alignas(16) Word16 {
  uint64_t lo;
  uint64_t hi;
};

// Byte offsets of outer row `row` on both sides. The outermost dim needs
// no division (row < rows), so one outer dim costs a multiply only.
FERRY_HOST_DEVICE FERRY_FORCE_INLINE void RowOffsets(const BoxCopyDesc& d,
                                                     int64_t row,
                                                     int64_t* src_off,
                                                     int64_t* dst_off) {
  int64_t s = 0, t = 0;
  for (int k = d.outer_rank - 1; k >= 1; --k) {
    const int64_t e = d.extent[k];
    const int64_t q = row / e;
    const int64_t i = row - q * e;
    s += i * d.src_stride[k];
    t += i * d.dst_stride[k];
    row = q;
  }
  if (d.outer_rank > 0) {
    s += row * d.src_stride[0];
    t += row * d.dst_stride[0];
  }
  *src_off = s;
  *dst_off = t;
}

// Copies `cols` words of one run: consecutive threads take consecutive
// words, four loads in flight before the stores.
template <typename Word>
FERRY_HOST_DEVICE FERRY_FORCE_INLINE void CopyRun(const Word* s, Word* t,
                                                  int64_t cols, int thread,
                                                  int threads) {
  int64_t c = thread;
  for (; c + 3 * threads < cols; c += 4 * threads) {
    const Word a = s[c];
    const Word b = s[c + threads];
    const Word e = s[c + 2 * threads];
    const Word f = s[c + 3 * threads];
    t[c] = a;
    t[c + threads] = b;
    t[c + 2 * threads] = e;
    t[c + 3 * threads] = f;
  }
  for (; c < cols; c += threads) t[c] = s[c];
}

// Copies tile `tile` of box `d`: this caller is thread `thread` of
// `threads` working on the tile together.
template <typename Word>
FERRY_HOST_DEVICE FERRY_FORCE_INLINE void CopyTile(const BoxCopyDesc& d,
                                                   int64_t tile, int thread,
                                                   int threads) {
  const int64_t row_tile = tile / d.col_tiles;
  const int64_t col0 = (tile - row_tile * d.col_tiles) * d.cols_per_tile;
  const int64_t row0 = row_tile * d.rows_per_tile;
  const int64_t rows = d.rows - row0 < d.rows_per_tile ? d.rows - row0
                                                       : d.rows_per_tile;
  const int64_t cols = d.inner_words - col0 < d.cols_per_tile
                           ? d.inner_words - col0
                           : d.cols_per_tile;
  if (rows == 1 || cols >= 4 * threads) {
    // Long runs (or part of one): run by run, all threads on each, four
    // words per thread in flight.
    for (int64_t r = 0; r < rows; ++r) {
      int64_t so, to;
      RowOffsets(d, row0 + r, &so, &to);
      CopyRun(reinterpret_cast<const Word*>(d.src + so) + col0,
              reinterpret_cast<Word*>(d.dst + to) + col0, cols, thread,
              threads);
    }
    return;
  }
  if (2 * cols >= threads) {
    // Medium runs (a bf16 shard of a 4096-wide row is 256 words): a thread
    // holds one to four words of a run, so run by run it would have one
    // load in flight at a time. Four runs at once instead: four loads in
    // flight before the stores (measured on an H200: 0.69x of cudaMemcpy
    // run by run).
    for (int64_t r = 0; r < rows; r += 4) {
      const int nr = rows - r < 4 ? static_cast<int>(rows - r) : 4;
      const Word* s[4];
      Word* t[4];
      for (int k = 0; k < 4; ++k) {
        int64_t so, to;
        RowOffsets(d, row0 + r + (k < nr ? k : 0), &so, &to);
        s[k] = reinterpret_cast<const Word*>(d.src + so) + col0;
        t[k] = reinterpret_cast<Word*>(d.dst + to) + col0;
      }
      for (int64_t c = thread; c < cols; c += threads) {
        if (nr == 4) {
          const Word a = s[0][c], b = s[1][c], e = s[2][c], f = s[3][c];
          t[0][c] = a;
          t[1][c] = b;
          t[2][c] = e;
          t[3][c] = f;
        } else {
          for (int k = 0; k < nr; ++k) t[k][c] = s[k][c];
        }
      }
    }
    return;
  }
  // Short runs: the tile is rows x cols words, at most
  // kTileBytes / word_bytes of them, so 32-bit index arithmetic suffices.
  // Four words per thread in flight.
  const uint32_t n = static_cast<uint32_t>(rows * cols);
  const uint32_t ucols = static_cast<uint32_t>(cols);
  const uint32_t step = static_cast<uint32_t>(threads);
  uint32_t i = static_cast<uint32_t>(thread);
  for (; i + 3 * step < n; i += 4 * step) {
    const Word* s[4];
    Word* t[4];
    for (uint32_t k = 0; k < 4; ++k) {
      const uint32_t j = i + k * step;
      const uint32_t r = j / ucols;
      const uint32_t c = j - r * ucols;
      int64_t so, to;
      RowOffsets(d, row0 + r, &so, &to);
      s[k] = reinterpret_cast<const Word*>(d.src + so) + col0 + c;
      t[k] = reinterpret_cast<Word*>(d.dst + to) + col0 + c;
    }
    const Word a = *s[0], b = *s[1], e = *s[2], f = *s[3];
    *t[0] = a;
    *t[1] = b;
    *t[2] = e;
    *t[3] = f;
  }
  for (; i < n; i += step) {
    const uint32_t r = i / ucols;
    const uint32_t c = i - r * ucols;
    int64_t so, to;
    RowOffsets(d, row0 + r, &so, &to);
    reinterpret_cast<Word*>(d.dst + to)[col0 + c] =
        reinterpret_cast<const Word*>(d.src + so)[col0 + c];
  }
}

// Dispatch on the word width (uniform across a tile: no divergence).
FERRY_HOST_DEVICE FERRY_FORCE_INLINE void CopyTileAnyWord(const BoxCopyDesc& d,
                                                          int64_t tile,
                                                          int thread,
                                                          int threads) {
  switch (d.word_bytes) {
    case 16:
      CopyTile<Word16>(d, tile, thread, threads);
      break;
    case 8:
      CopyTile<uint64_t>(d, tile, thread, threads);
      break;
    case 4:
      CopyTile<uint32_t>(d, tile, thread, threads);
      break;
    case 2:
      CopyTile<uint16_t>(d, tile, thread, threads);
      break;
    default:
      CopyTile<uint8_t>(d, tile, thread, threads);
      break;
  }
}

// Index of the descriptor holding `tile`. REQUIRES: n > 0, descs sorted
// by first_tile, descs[0].first_tile == 0, every box has tiles.
FERRY_HOST_DEVICE FERRY_FORCE_INLINE int32_t FindBox(const BoxCopyDesc* descs,
                                                     int32_t n, int64_t tile) {
  int32_t lo = 0, hi = n - 1;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (descs[mid].first_tile <= tile) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// The kernel's host-side launcher (box_copy_kernel.cu). `descs` is a device
// array of `n` descriptors covering `total_tiles`; `stream` a cudaStream_t.
// Returns the cudaError_t of the launch as an int (0: launched).
int LaunchBoxCopyKernel(const BoxCopyDesc* descs, int32_t n,
                        int64_t total_tiles, int max_blocks, void* stream);

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_KERNELS_BOX_COPY_DESC_H_
