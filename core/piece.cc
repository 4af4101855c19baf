#include "core/piece.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"

namespace ferry {

Dims StorageShape(const Dims& shape, DType dtype) {
  Dims out = shape;
  if (!out.empty()) out.back() /= BlockElems(dtype);
  return out;
}

Box StorageBox(const Box& box, DType dtype) {
  Box out = box;
  if (!out.offset.empty()) {
    const int64_t b = BlockElems(dtype);
    out.offset.back() /= b;
    out.extent.back() /= b;
  }
  return out;
}

Piece Piece::Contiguous(int32_t param, Box box, uint32_t buffer,
                        int64_t byte_offset, DType dtype) {
  Piece p;
  p.param = param;
  p.strides = RowMajorStrides(StorageShape(box.extent, dtype));
  p.box = std::move(box);
  p.buffer = buffer;
  p.byte_offset = byte_offset;
  return p;
}

Piece Piece::InLocalTensor(int32_t param, Box box, uint32_t buffer,
                           int64_t tensor_offset, const Dims& local_shape,
                           const Dims& local_offset, DType dtype) {
  Piece p;
  p.param = param;
  p.strides = RowMajorStrides(StorageShape(local_shape, dtype));
  const Dims unit_offset = StorageShape(local_offset, dtype);
  int64_t units = 0;
  for (size_t i = 0; i < unit_offset.size(); ++i) {
    units += unit_offset[i] * p.strides[i];
  }
  p.box = std::move(box);
  p.buffer = buffer;
  p.byte_offset = tensor_offset + units * UnitBytes(dtype);
  return p;
}

int64_t ByteOffsetOf(const Piece& piece, const Box& sub, DType dtype) {
  const int64_t b = BlockElems(dtype);
  const size_t n = sub.rank();
  int64_t units = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t delta = sub.offset[i] - piece.box.offset[i];
    if (i + 1 == n) delta /= b;
    units += delta * piece.strides[i];
  }
  return piece.byte_offset + units * UnitBytes(dtype);
}

absl::StatusOr<int64_t> PieceEndByte(const Piece& piece, DType dtype) {
  // The box in storage units, read in place: StorageBox would copy it,
  // and this runs for each of millions of pieces.
  const size_t rank = piece.box.rank();
  const int64_t block = BlockElems(dtype);
  int64_t last_unit = 0;  // units from the first to the last touched unit
  for (size_t i = 0; i < rank; ++i) {
    const int64_t extent =
        i + 1 == rank ? piece.box.extent[i] / block : piece.box.extent[i];
    if (extent == 0) return piece.byte_offset;
    if (piece.strides[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stride ", piece.strides[i], " of dim ", i, " is negative"));
    }
    int64_t step;
    if (!CheckedMul(extent - 1, piece.strides[i], &step) ||
        !CheckedAdd(last_unit, step, &last_unit)) {
      return absl::InvalidArgumentError("piece strides overflow");
    }
  }
  int64_t end;
  if (!CheckedAdd(last_unit, 1, &end) ||
      !CheckedMul(end, UnitBytes(dtype), &end) ||
      !CheckedAdd(end, piece.byte_offset, &end)) {
    return absl::InvalidArgumentError("piece extent overflows 64 bits");
  }
  return end;
}

bool HasStagingPieces(const std::vector<RankLayout>& layout) {
  for (const RankLayout& rank : layout) {
    for (const Piece& p : rank.pieces) {
      if (p.buffer & kStagingBufferBit) return true;
    }
  }
  return false;
}

}  // namespace ferry
