#include "transport/unit_range.h"

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/region_copy.h"

namespace ferry {
namespace {

int64_t Dot(const Dims& index, const Dims& strides) {
  int64_t at = 0;
  for (size_t i = 0; i < index.size(); ++i) at += index[i] * strides[i];
  return at;
}

// Calls fn(offset, sub_extent, first_unit) for the sub-boxes that cover
// units [begin, end), in row-major order. The whole box is the common case
// and skips the decomposition (and its allocation).
template <typename Fn>
void ForEachSubBox(const Dims& extent, int64_t begin, int64_t end, Fn&& fn) {
  if (begin >= end) return;
  if (begin == 0 && end == Volume(extent)) {
    fn(Dims(extent.size(), 0), extent, int64_t{0});
    return;
  }
  const Dims row_major = RowMajorStrides(extent);
  for (const Box& sub : FlatRangeToBoxes(extent, begin, end)) {
    fn(sub.offset, sub.extent, Dot(sub.offset, row_major));
  }
}

}  // namespace

absl::Status ValidateRegionBox(const RegionView& region, const Dims& extent,
                               int64_t unit_bytes, absl::string_view what,
                               int64_t* bytes) {
  if (region.strides.size() != extent.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": extent ", DimsToString(extent), " has rank ", extent.size(),
        " but its strides ", DimsToString(region.strides), " have rank ",
        region.strides.size()));
  }
  if (unit_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": unit_bytes must be positive, got ", unit_bytes));
  }
  int64_t total = unit_bytes;
  for (size_t i = 0; i < extent.size(); ++i) {
    if (extent[i] < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": extent ", DimsToString(extent), " has a negative dim"));
    }
    if (!CheckedMul(total, extent[i], &total)) {
      return absl::InvalidArgumentError(absl::StrCat(
          what, ": extent ", DimsToString(extent), " overflows 64 bits"));
    }
  }
  if (total > 0 && region.base == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": a non-empty box has no base address"));
  }
  *bytes = total;
  return absl::OkStatus();
}

bool IsRowMajorContiguous(const Dims& extent, const Dims& strides) {
  int64_t run = 1;
  for (size_t i = extent.size(); i-- > 0;) {
    if (extent[i] == 1) continue;
    if (strides[i] != run) return false;
    run *= extent[i];
  }
  return true;
}

void CopyUnitRange(const RegionView& src, const RegionView& dst,
                   const Dims& extent, int64_t unit_bytes, int64_t begin,
                   int64_t end, StoreHint hint) {
  ForEachSubBox(extent, begin, end,
                [&](const Dims& offset, const Dims& sub, int64_t) {
                  CopyStrided(
                      src.base + Dot(offset, src.strides) * unit_bytes,
                      src.strides,
                      dst.base + Dot(offset, dst.strides) * unit_bytes,
                      dst.strides, sub, unit_bytes, hint);
                });
}

void PackUnitRange(const RegionView& src, const Dims& extent,
                   int64_t unit_bytes, int64_t begin, int64_t end,
                   uint8_t* packed) {
  const Dims row_major = RowMajorStrides(extent);
  ForEachSubBox(extent, begin, end,
                [&](const Dims& offset, const Dims& sub, int64_t first) {
                  CopyStrided(src.base + Dot(offset, src.strides) * unit_bytes,
                              src.strides,
                              packed + (first - begin) * unit_bytes, row_major,
                              sub, unit_bytes);
                });
}

void UnpackUnitRange(const uint8_t* packed, const RegionView& dst,
                     const Dims& extent, int64_t unit_bytes, int64_t begin,
                     int64_t end) {
  const Dims row_major = RowMajorStrides(extent);
  ForEachSubBox(extent, begin, end,
                [&](const Dims& offset, const Dims& sub, int64_t first) {
                  CopyStrided(packed + (first - begin) * unit_bytes, row_major,
                              dst.base + Dot(offset, dst.strides) * unit_bytes,
                              dst.strides, sub, unit_bytes);
                });
}

}  // namespace ferry
