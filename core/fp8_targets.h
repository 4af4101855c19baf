// FP8 in flight (issue 40; docs/api.md, "Quantized in flight"): how an
// engine declares a live FP8 weight fed from a wider checkpoint parameter,
// and what layout resolution makes of it.
//
// The engine serves FP8 with block scales (DeepSeek-V3, Kimi-K2): its live
// `weight` is float8 (e4m3, or e5m2) and its live `weight_scale_inv` is
// float32, one per block of 128 x 128 elements over the last two dims. The
// trainer holds bf16 (or f16, or f32). The engine declares the weight with
// an Fp8Declaration naming its scale tensor; resolution then places whole
// blocks of the checkpoint parameter into the live tensor (a
// QuantizedTarget per box), quantized with the rule of core/fp8_blocks.h.
//
// There is no fallback for such a weight: an FP8 engine's own loader takes
// FP8 checkpoint tensors, not bf16 ones. So what would fall back for a
// plain parameter (a custom loader, a shard that cuts a block) is an
// error for a quantized one, naming the parameter, the rank and the box.
//
// The blocks are the live tensor's: block (i, j) of a rank's live weight
// is the element box [i*128, (i+1)*128) x [j*128, (j+1)*128) of that
// tensor, short at its end. They are the checkpoint tensor's blocks only
// when every box a rank holds starts on a checkpoint block boundary and
// ends on one or at the checkpoint's end, and sits at a live block
// boundary: the condition vLLM's block-FP8 linear layers put on their
// shards (Fp8LinearMethod refuses a TP shard that is not whole blocks).
// Fp8BlockCut checks it.
//
// Pure; any thread.
#ifndef FERRY_CORE_FP8_TARGETS_H_
#define FERRY_CORE_FP8_TARGETS_H_

#include <cstdint>
#include <string>

#include "core/dtype.h"
#include "core/geometry.h"

namespace ferry {

// On a live FP8 weight: where its scales are, and the block shape.
struct Fp8Declaration {
  // The engine parameter of the same rank holding the block scales
  // (vLLM's "...weight_scale_inv"): float32, shape the weight's lead dims
  // then ceil(rows / block_rows), ceil(cols / block_cols). Empty: the
  // parameter is not quantized in flight.
  std::string scale;
  int64_t block_rows = 128;
  int64_t block_cols = 128;

  bool declared() const { return !scale.empty(); }
  bool operator==(const Fp8Declaration& o) const {
    return scale == o.scale && block_rows == o.block_rows &&
           block_cols == o.block_cols;
  }
  bool operator!=(const Fp8Declaration& o) const { return !(*this == o); }
};

// Whether a checkpoint dtype can be quantized to FP8 (kBF16, kF16, kF32).
bool IsFp8Source(DType dtype);
// Whether `dtype` is an FP8 format (kF8E4M3, kF8E5M2).
bool IsFp8Format(DType dtype);

// The scale tensor's shape for a live weight of `local_shape` (at least two
// dims): the lead dims, then the block grid of the last two.
// REQUIRES: block_rows, block_cols > 0.
Dims Fp8ScaleShape(const Dims& local_shape, int64_t block_rows,
                   int64_t block_cols);

// One box of a checkpoint parameter that a rank receives quantized: the
// elements go to the live FP8 weight, the scales of its blocks to the live
// scale tensor. Strides are in elements of each side (one byte per FP8
// element, one float32 per scale), over the box's dims (the checkpoint's;
// the live tensor's lead dims, a MoE expert index, are in the offsets).
struct QuantizedTarget {
  int32_t param = -1;  // the checkpoint parameter (bf16, f16 or f32)
  Box box;  // of it, in elements, whole blocks but at the tensor's end
  DType format = DType::kF8E4M3;
  int64_t block_rows = 128;
  int64_t block_cols = 128;
  uint32_t weight_buffer = 0;
  int64_t weight_offset = 0;  // bytes to the box's first element
  Dims weight_strides;        // elements
  uint32_t scale_buffer = 0;
  int64_t scale_offset = 0;  // bytes to the box's first block's scale
  Dims scale_strides;        // float32s

  // The box's blocks: the box in units of blocks over the last two dims.
  Box ScaleBox() const;
};

// Why the placement of checkpoint `box` (of a tensor of `shape`) at
// `local_offset` of a live tensor of `local_shape` cuts a block of
// block_rows x block_cols over the last two dims; empty when it cuts none
// (see the top). `box` has the checkpoint's dims; `local_offset` and
// `local_shape` the live tensor's, lead dims first.
std::string Fp8BlockCut(const Box& box, const Dims& shape,
                        const Dims& local_offset, const Dims& local_shape,
                        int64_t block_rows, int64_t block_cols);

}  // namespace ferry

#endif  // FERRY_CORE_FP8_TARGETS_H_
