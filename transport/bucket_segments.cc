#include "transport/bucket_segments.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "transport/unit_range.h"

namespace ferry {

absl::Status ValidateBucketView(const BucketView& bucket) {
  const size_t n = bucket.regions.size();
  if (bucket.extents.size() != n || bucket.unit_bytes.size() != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bucket ", bucket.id, ": ", n, " regions, ", bucket.extents.size(),
        " extents and ", bucket.unit_bytes.size(), " unit sizes"));
  }
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    int64_t bytes = 0;
    absl::Status s = ValidateRegionBox(
        bucket.regions[i], bucket.extents[i], bucket.unit_bytes[i],
        absl::StrCat("bucket ", bucket.id, " box ", i), &bytes);
    if (!s.ok()) return s;
    if (!CheckedAdd(total, bytes, &total)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bucket ", bucket.id, ": byte size overflows 64 bits"));
    }
  }
  if (total != bucket.bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("bucket ", bucket.id, ": boxes hold ", total,
                     " bytes but the bucket says ", bucket.bytes));
  }
  return absl::OkStatus();
}

std::vector<PackedSegment> SplitIntoSegments(const BucketView& bucket,
                                             int64_t max_bytes) {
  std::vector<PackedSegment> out;
  int64_t offset = 0;
  for (size_t i = 0; i < bucket.regions.size(); ++i) {
    const int64_t unit = bucket.unit_bytes[i];
    const int64_t units = Volume(bucket.extents[i]);
    const int64_t step = std::max<int64_t>(1, max_bytes / unit);
    for (int64_t begin = 0; begin < units; begin += step) {
      PackedSegment seg;
      seg.box = static_cast<int32_t>(i);
      seg.unit_begin = begin;
      seg.unit_end = std::min(units, begin + step);
      seg.offset = offset;
      seg.bytes = (seg.unit_end - seg.unit_begin) * unit;
      offset += seg.bytes;
      out.push_back(seg);
    }
  }
  return out;
}

void PackSegment(const BucketView& bucket, const PackedSegment& segment,
                 uint8_t* packed) {
  PackUnitRange(bucket.regions[segment.box], bucket.extents[segment.box],
                bucket.unit_bytes[segment.box], segment.unit_begin,
                segment.unit_end, packed);
}

void UnpackSegment(const BucketView& bucket, const PackedSegment& segment,
                   const uint8_t* packed) {
  UnpackUnitRange(packed, bucket.regions[segment.box],
                  bucket.extents[segment.box], bucket.unit_bytes[segment.box],
                  segment.unit_begin, segment.unit_end);
}

uint8_t* ContiguousSpan(const BucketView& bucket,
                        const PackedSegment& segment) {
  const RegionView& region = bucket.regions[segment.box];
  if (!IsRowMajorContiguous(bucket.extents[segment.box], region.strides)) {
    return nullptr;
  }
  return region.base + segment.unit_begin * bucket.unit_bytes[segment.box];
}

}  // namespace ferry
