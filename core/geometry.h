// Shapes and boxes of N-dimensional tensors (any number of dimensions).
//
// A Box is a per-dimension half-open interval [offset, offset + extent) of a
// tensor. Boxes are how ferry says "this part of that parameter": a TP shard
// is a box, an FSDP flat range is a few boxes, an intersection of two shards
// is a box. All arithmetic on client-supplied numbers is overflow-checked by
// the Validate* functions; the other functions assume validated inputs.
#ifndef FERRY_CORE_GEOMETRY_H_
#define FERRY_CORE_GEOMETRY_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace ferry {

// Sizes, offsets or strides, one per dimension. Two inline cover every
// checkpoint tensor in the model files (weights are 2-D, norms and biases
// 1-D), so a box of one is 48 bytes; more dims (an engine's fused MoE
// tensor, a GGUF file's merged experts) spill to the heap, which costs an
// allocation but only for the few tensors that have them. With four inline
// a Kimi-K2-sized plan's 2.2M destination pieces took 107 MiB more.
using Dims = absl::InlinedVector<int64_t, 2>;

struct Box {
  Dims offset;
  Dims extent;

  size_t rank() const { return offset.size(); }
  bool operator==(const Box& o) const {
    return offset == o.offset && extent == o.extent;
  }
  bool operator!=(const Box& o) const { return !(*this == o); }
  bool operator<(const Box& o) const {
    return offset != o.offset ? offset < o.offset : extent < o.extent;
  }
};

// The box covering a whole tensor of `shape`.
Box FullBox(const Dims& shape);

// Product of the dims. REQUIRES: validated (no overflow possible).
int64_t Volume(const Dims& dims);
inline int64_t Volume(const Box& box) { return Volume(box.extent); }

// Every dim >= 0 and the product of the non-zero dims times `unit_bytes`
// fits in int64: the element count, the byte size and the row-major strides
// of the shape and of every box inside it then fit too.
absl::Status ValidateShape(const Dims& shape, int64_t unit_bytes = 1);

// Same rank as `shape`, extents >= 0, offsets >= 0 and the box inside it.
absl::Status ValidateBoxInShape(const Box& box, const Dims& shape);

// The overlap of two boxes of the same rank, or nullopt when it is empty.
std::optional<Box> Intersect(const Box& a, const Box& b);
bool Overlaps(const Box& a, const Box& b);
bool Contains(const Box& outer, const Box& inner);

// Row-major strides (in elements) of a contiguous tensor of `shape`.
Dims RowMajorStrides(const Dims& shape);

// Decomposes the flat range [begin, end) of a row-major tensor of `shape`
// (an FSDP flat shard) into boxes, each contiguous in flat order, in flat
// order. At most 2 * rank - 1 boxes. REQUIRES: 0 <= begin <= end <=
// Volume(shape).
std::vector<Box> FlatRangeToBoxes(const Dims& shape, int64_t begin,
                                  int64_t end);

// "[0:4096, 1024:2048]" — offsets and ends, as error messages show boxes.
std::string BoxToString(const Box& box);
// "[4096, 1024]"
std::string DimsToString(const Dims& dims);

}  // namespace ferry

#endif  // FERRY_CORE_GEOMETRY_H_
