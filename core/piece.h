// Pieces: how a rank's local memory maps onto checkpoint parameters.
//
// A checkpoint parameter (Hugging Face name, dtype, global shape) is the
// unit both sides agree on. A rank describes what it holds as a list of
// pieces; each piece says "this box of that parameter lives in my buffer B,
// starting at byte O, with these strides". That one idea covers TP shards
// (column, row, uneven, padded), replicas (DP, GQA kv heads), fused tensors
// (qkv_proj, gate_up_proj, MoE w13), PP and EP (no piece at all), FSDP flat
// shards (a flat range is a few boxes, each contiguous) and block-quantized
// storage. Sources and destinations are described the same way; the planner
// only ever intersects pieces.
//
// Units: boxes are in elements of the checkpoint parameter. Strides are in
// storage units (elements, or blocks for block-quantized dtypes, whose last
// dimension is then counted in blocks). Byte offsets are in bytes from the
// start of the rank's buffer.
#ifndef FERRY_CORE_PIECE_H_
#define FERRY_CORE_PIECE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/geometry.h"
#include "core/model_spec.h"

namespace ferry {

// Buffer ids with this bit set name daemon-owned staging (fallback tensors
// assembled for an engine's own loader), not client-registered memory.
constexpr uint32_t kStagingBufferBit = 0x80000000u;

// Ordered so that no padding falls between the fields: a Kimi-K2-sized
// destination layout holds 2.2M pieces (88 bytes each with 2-D boxes).
struct Piece {
  int32_t param = -1;   // index into the ModelSpec
  uint32_t buffer = 0;  // which of the rank's buffers holds it
  int64_t byte_offset = 0;  // bytes from the buffer start to box.offset
  Box box;              // box of the parameter, elements
  Dims strides;  // storage units per step in each dim of the box

  // The same box stored row-major and contiguous at `byte_offset`.
  static Piece Contiguous(int32_t param, Box box, uint32_t buffer,
                          int64_t byte_offset, DType dtype);
  // Box `box` of a contiguous local tensor of shape `local_shape` stored at
  // `tensor_offset`, with the box's local position `local_offset`.
  static Piece InLocalTensor(int32_t param, Box box, uint32_t buffer,
                             int64_t tensor_offset, const Dims& local_shape,
                             const Dims& local_offset, DType dtype);
};

// Storage geometry of a box of a dtype: the box with its last dim counted
// in units (blocks for block-quantized dtypes). REQUIRES: aligned (checked
// by validation).
Box StorageBox(const Box& box, DType dtype);
Dims StorageShape(const Dims& shape, DType dtype);

// Bytes from the piece's start to the start of `sub` (a box inside it).
int64_t ByteOffsetOf(const Piece& piece, const Box& sub, DType dtype);

// The last byte a piece touches + 1, relative to its buffer; an error when
// that overflows.
absl::StatusOr<int64_t> PieceEndByte(const Piece& piece, DType dtype);

// What one rank holds.
struct RankLayout {
  int32_t rank = 0;      // rank within its group (trainer world or instance)
  std::string node;      // node (daemon) that hosts the rank
  std::vector<Piece> pieces;
  // Sizes of the rank's registered buffers, by buffer id; pieces must lie
  // inside them. Empty means "not checked here" (layout built in tests).
  std::vector<int64_t> buffer_bytes;
  // The client's region id of each buffer, for messages ("region 7"); empty
  // means messages name the dense buffer index.
  std::vector<uint32_t> buffer_ids;
};

// Whether any rank of the layout has a piece in daemon staging (a fallback
// tensor): such an instance is relayed between nodes from the sources,
// since staging is not relayed there.
bool HasStagingPieces(const std::vector<RankLayout>& layout);

}  // namespace ferry

#endif  // FERRY_CORE_PIECE_H_
