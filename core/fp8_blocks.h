// FP8 with 128x128 block scales, as the FP8 engines of DeepSeek-V3 and
// Kimi-K2 serve it: `weight` as float8 (e4m3fn, or e5m2) and
// `weight_scale_inv` as float32, one per block of block_rows x block_cols
// (128 x 128 unless declared otherwise; the last block of a dimension may
// be short).
//
// The rule is DeepGEMM's `per_block_cast_to_fp8`, the reference those
// engines are tested against, so that a weight quantized here, on a GPU,
// or by the engine's own loader is the same bytes:
//   amax      = max(|x|) over the block, in float32, clamped below at 1e-4
//   element   = float32(x) * (448 / amax), rounded to e4m3 to nearest
//               even, saturating at +-448 (57344 for e5m2)
//   scale_inv = amax / 448
// in float32 arithmetic, in that order (x * (448 / amax), not x * 448 /
// amax). For e5m2 the 448 above is 57344, e5m2's largest finite value.
//
// Threading: pure functions; QuantizeBlocks may be called for disjoint
// outputs from many threads.
#ifndef FERRY_CORE_FP8_BLOCKS_H_
#define FERRY_CORE_FP8_BLOCKS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "core/dtype.h"

namespace ferry {

// One float to float8 e4m3fn (bias 7, 3 mantissa bits, no infinities;
// NaN is 0x7f / 0xff): round to nearest even, saturating at +-448; NaN
// stays NaN, -0 stays -0.
uint8_t FloatToE4M3(float x);
// One float to float8 e5m2 (bias 15, 2 mantissa bits): likewise,
// saturating at +-57344 (an infinity saturates too).
uint8_t FloatToE5M2(float x);
// The exact value of a float8 byte.
float E4M3ToFloat(uint8_t b);
float E5M2ToFloat(uint8_t b);

// The largest finite value of `fp8` (kF8E4M3: 448, kF8E5M2: 57344).
float Fp8Max(DType fp8);

// A row-major [rows, cols] tensor cut into blocks.
struct Fp8BlockShape {
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t block_rows = 128;
  int64_t block_cols = 128;

  int64_t block_grid_rows() const {
    return (rows + block_rows - 1) / block_rows;
  }
  int64_t block_grid_cols() const {
    return (cols + block_cols - 1) / block_cols;
  }
};

// OK when QuantizeBlocks (or the GPU kernel) takes these dtypes and this
// shape; INVALID_ARGUMENT naming what is wrong otherwise.
absl::Status CheckFp8BlockArguments(DType src_dtype,
                                    const Fp8BlockShape& shape, DType fp8);

// Quantizes `src` (kF32, kF16 or kBF16, row-major [rows, cols]) into
// `out` (rows * cols bytes of `fp8`, kF8E4M3 or kF8E5M2, row-major) and
// `scale_inv` (block_grid_rows * block_grid_cols floats, row-major).
// INVALID_ARGUMENT names what is wrong with the shape or dtypes.
absl::Status QuantizeBlocks(const void* src, DType src_dtype,
                            const Fp8BlockShape& shape, DType fp8,
                            uint8_t* out, float* scale_inv);

// A tensor whose elements several nodes hold (FSDP over trainer nodes,
// core/fp8_sources.h) is quantized by each holder for its own elements,
// exactly as if whole: a block's amax is the largest |x| over all of its
// elements, and each element's code depends on its value and that amax
// alone. So each holder reads its parts' blocks' max |x| (BlockAbsMaxBits,
// the elements it does not hold as zeros, which never raise a max), the
// largest bits per block win (for non-negative floats, the larger bits
// are the larger value, and a NaN's bits are above every number's), and
// each holder quantizes its parts with the combined grid
// (QuantizeBlocksWithAmax).

// Each block's max |x| as float bits, not clamped: `max_bits` gets
// block_grid_rows * block_grid_cols values, row-major. INVALID_ARGUMENT as
// QuantizeBlocks.
absl::Status BlockAbsMaxBits(const void* src, DType src_dtype,
                             const Fp8BlockShape& shape, uint32_t* max_bits);

// QuantizeBlocks with each block's max |x| given as bits (`max_bits`, the
// grid BlockAbsMaxBits fills) rather than read from `src`; null reads it.
absl::Status QuantizeBlocksWithAmax(const void* src, DType src_dtype,
                                    const Fp8BlockShape& shape, DType fp8,
                                    const uint32_t* max_bits, uint8_t* out,
                                    float* scale_inv);

// The same over rows [first_row, first_row + rows) of the tensor `shape`
// describes, held row-major from that row at `src` (and written so at
// `out`): a holder's rows, which may start and end inside a block row.
// `max_bits` (the whole grid) is required unless the range is the whole
// tensor; `scale_inv` (the whole grid; its block rows the range touches
// are written) may be null. INVALID_ARGUMENT for a range outside the
// tensor.
absl::Status QuantizeRows(const void* src, DType src_dtype,
                          const Fp8BlockShape& shape, int64_t first_row,
                          int64_t rows, DType fp8, const uint32_t* max_bits,
                          uint8_t* out, float* scale_inv);

// Raises each block's bits in `max_bits` (the whole grid) to the max |x|
// of its elements in rows [first_row, first_row + rows), held as
// QuantizeRows reads them.
absl::Status RaiseRowsAbsMaxBits(const void* src, DType src_dtype,
                                 const Fp8BlockShape& shape, int64_t first_row,
                                 int64_t rows, uint32_t* max_bits);

// A block's scale_inv from its max |x|'s bits: the rule's clamp and
// division, as QuantizeBlocks computes it.
float Fp8ScaleInv(uint32_t max_bits, DType fp8);

}  // namespace ferry

#endif  // FERRY_CORE_FP8_BLOCKS_H_
