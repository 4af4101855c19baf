#include "core/geometry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/checked_math.h"

namespace ferry {

Box FullBox(const Dims& shape) {
  Box box;
  box.offset.assign(shape.size(), 0);
  box.extent = shape;
  return box;
}

int64_t Volume(const Dims& dims) {
  int64_t v = 1;
  for (int64_t d : dims) v *= d;
  return v;
}

absl::Status ValidateShape(const Dims& shape, int64_t unit_bytes) {
  int64_t bytes = unit_bytes;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", DimsToString(shape), " has a negative dim ", i));
    }
    // Zero dims are left out of the product: a shape without elements still
    // has row-major strides (products of the dims after each), which must
    // fit as well ([0, 2^62, 4] has a stride of 2^64).
    if (shape[i] != 0 && !CheckedMul(bytes, shape[i], &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "shape ", DimsToString(shape),
          " is too large: its byte size or strides overflow 64 bits"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateBoxInShape(const Box& box, const Dims& shape) {
  if (box.offset.size() != shape.size() || box.extent.size() != shape.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("box ", BoxToString(box), " has rank ", box.offset.size(),
                     "/", box.extent.size(), " but the tensor has rank ",
                     shape.size()));
  }
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t end;
    if (box.offset[i] < 0 || box.extent[i] < 0 ||
        !CheckedAdd(box.offset[i], box.extent[i], &end) || end > shape[i]) {
      return absl::InvalidArgumentError(
          absl::StrCat("box ", BoxToString(box), " lies outside shape ",
                       DimsToString(shape), " in dim ", i));
    }
  }
  return absl::OkStatus();
}

std::optional<Box> Intersect(const Box& a, const Box& b) {
  Box out;
  const size_t n = a.rank();
  out.offset.resize(n);
  out.extent.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t lo = std::max(a.offset[i], b.offset[i]);
    const int64_t hi =
        std::min(a.offset[i] + a.extent[i], b.offset[i] + b.extent[i]);
    if (hi <= lo) return std::nullopt;
    out.offset[i] = lo;
    out.extent[i] = hi - lo;
  }
  return out;
}

bool Overlaps(const Box& a, const Box& b) {
  for (size_t i = 0; i < a.rank(); ++i) {
    if (std::max(a.offset[i], b.offset[i]) >=
        std::min(a.offset[i] + a.extent[i], b.offset[i] + b.extent[i])) {
      return false;
    }
  }
  return true;
}

bool Contains(const Box& outer, const Box& inner) {
  for (size_t i = 0; i < outer.rank(); ++i) {
    if (inner.offset[i] < outer.offset[i] ||
        inner.offset[i] + inner.extent[i] >
            outer.offset[i] + outer.extent[i]) {
      return false;
    }
  }
  return true;
}

Dims RowMajorStrides(const Dims& shape) {
  Dims strides(shape.size(), 1);
  for (size_t i = shape.size(); i-- > 1;) {
    strides[i - 1] = strides[i] * shape[i];
  }
  return strides;
}

namespace {

// Appends the boxes of the flat range [begin, end) within the sub-tensor
// whose leading `dim` coordinates are fixed by `prefix`. `inner` is the
// element count of one index step at `dim` (product of dims after it).
void AppendFlatBoxes(const Dims& shape, const Dims& inner, size_t dim,
                     Dims& prefix, int64_t begin, int64_t end,
                     std::vector<Box>* out) {
  if (begin >= end) return;
  const size_t n = shape.size();
  const int64_t step = inner[dim];
  auto emit = [&](int64_t first, int64_t count) {
    Box box;
    box.offset = prefix;
    box.extent.assign(dim, 1);
    box.offset.push_back(first);
    box.extent.push_back(count);
    for (size_t i = dim + 1; i < n; ++i) {
      box.offset.push_back(0);
      box.extent.push_back(shape[i]);
    }
    out->push_back(std::move(box));
  };
  const int64_t first_full = (begin + step - 1) / step;  // first whole slab
  const int64_t end_full = end / step;                   // one past last
  if (first_full >= end_full) {
    // No whole slab: the range lies within one or two partial slabs.
    const int64_t lo_index = begin / step;
    const int64_t hi_index = (end - 1) / step;
    for (int64_t idx = lo_index; idx <= hi_index; ++idx) {
      const int64_t lo = std::max(begin, idx * step) - idx * step;
      const int64_t hi = std::min(end, (idx + 1) * step) - idx * step;
      if (lo == 0 && hi == step) {
        emit(idx, 1);
      } else {
        prefix.push_back(idx);
        AppendFlatBoxes(shape, inner, dim + 1, prefix, lo, hi, out);
        prefix.pop_back();
      }
    }
    return;
  }
  if (begin < first_full * step) {
    const int64_t idx = first_full - 1;
    prefix.push_back(idx);
    AppendFlatBoxes(shape, inner, dim + 1, prefix, begin - idx * step, step,
                    out);
    prefix.pop_back();
  }
  emit(first_full, end_full - first_full);
  if (end > end_full * step) {
    prefix.push_back(end_full);
    AppendFlatBoxes(shape, inner, dim + 1, prefix, 0, end - end_full * step,
                    out);
    prefix.pop_back();
  }
}

}  // namespace

std::vector<Box> FlatRangeToBoxes(const Dims& shape, int64_t begin,
                                  int64_t end) {
  std::vector<Box> out;
  if (begin >= end) return out;
  if (shape.empty()) {  // a scalar: one element, one box of rank 0
    out.push_back(Box{});
    return out;
  }
  const Dims inner = RowMajorStrides(shape);
  Dims prefix;
  AppendFlatBoxes(shape, inner, 0, prefix, begin, end, &out);
  return out;
}

std::string BoxToString(const Box& box) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < box.rank(); ++i) {
    parts.push_back(absl::StrCat(box.offset[i], ":",
                                 box.offset[i] + box.extent[i]));
  }
  return absl::StrCat("[", absl::StrJoin(parts, ", "), "]");
}

std::string DimsToString(const Dims& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

}  // namespace ferry
