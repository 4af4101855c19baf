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

}  // namespace ferry

#endif  // FERRY_CORE_FP8_BLOCKS_H_
