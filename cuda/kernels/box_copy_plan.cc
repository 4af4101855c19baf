#include "cuda/kernels/box_copy_plan.h"

#include <algorithm>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "core/geometry.h"
#include "transport/unit_range.h"

namespace ferry {
namespace gpu {
namespace {

int64_t Dot(const Dims& index, const Dims& strides) {
  int64_t at = 0;
  for (size_t i = 0; i < index.size(); ++i) at += index[i] * strides[i];
  return at;
}

// Largest power of two <= 16 dividing every bit pattern or'ed into `bits`.
int32_t WordBytes(uint64_t bits) {
  for (int32_t w = 16; w > 1; w /= 2) {
    if ((bits & static_cast<uint64_t>(w - 1)) == 0) return w;
  }
  return 1;
}

}  // namespace

absl::Status BoxCopyPlan::Add(const LocalCopy& c, absl::string_view what) {
  int64_t bytes = 0, dst_bytes = 0;
  if (absl::Status s =
          ValidateRegionBox(c.src, c.extent, c.unit_bytes, what, &bytes);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          ValidateRegionBox(c.dst, c.extent, c.unit_bytes, what, &dst_bytes);
      !s.ok()) {
    return s;
  }
  if (bytes == 0) return absl::OkStatus();

  // Coalesce (as core/region_copy.cc): drop unit dims, fold the inner run,
  // merge uniform outer dims.
  Dims e, s, d;
  for (size_t i = 0; i < c.extent.size(); ++i) {
    if (c.extent[i] == 1) continue;
    e.push_back(c.extent[i]);
    s.push_back(c.src.strides[i]);
    d.push_back(c.dst.strides[i]);
  }
  int64_t run_units = 1;
  while (!e.empty() && s.back() == run_units && d.back() == run_units) {
    run_units *= e.back();
    e.pop_back();
    s.pop_back();
    d.pop_back();
  }
  Dims oe, os, od;
  for (size_t i = 0; i < e.size(); ++i) {
    if (!oe.empty() && os.back() == s[i] * e[i] && od.back() == d[i] * e[i]) {
      oe.back() *= e[i];
      os.back() = s[i];
      od.back() = d[i];
    } else {
      oe.push_back(e[i]);
      os.push_back(s[i]);
      od.push_back(d[i]);
    }
  }
  AddCoalesced(reinterpret_cast<uint64_t>(c.src.base),
               reinterpret_cast<uint64_t>(c.dst.base), run_units * c.unit_bytes,
               c.unit_bytes, oe, os, od);
  return absl::OkStatus();
}

void BoxCopyPlan::AddCoalesced(uint64_t src, uint64_t dst, int64_t inner_bytes,
                               int64_t unit_bytes, const Dims& oe, const Dims& os,
                               const Dims& od) {
  // A box of rank 8 whose every dim is strided keeps 8 outer dims: one
  // more than a descriptor holds. Such a box (rare: only the innermost dim
  // of a real layout is ever that short) becomes one descriptor per index
  // of its outermost dim.
  if (oe.size() > static_cast<size_t>(kMaxOuterDims)) {
    const Dims e(oe.begin() + 1, oe.end()), s(os.begin() + 1, os.end()),
        d(od.begin() + 1, od.end());
    for (int64_t i = 0; i < oe[0]; ++i) {
      AddCoalesced(src + i * os[0] * unit_bytes, dst + i * od[0] * unit_bytes,
                   inner_bytes, unit_bytes, e, s, d);
    }
    return;
  }
  BoxCopyDesc desc;
  desc.src = src;
  desc.dst = dst;
  uint64_t bits = desc.src | desc.dst | static_cast<uint64_t>(inner_bytes);
  desc.outer_rank = static_cast<int32_t>(oe.size());
  desc.rows = 1;
  for (size_t i = 0; i < oe.size(); ++i) {
    desc.extent[i] = oe[i];
    desc.src_stride[i] = os[i] * unit_bytes;
    desc.dst_stride[i] = od[i] * unit_bytes;
    bits |= static_cast<uint64_t>(std::llabs(desc.src_stride[i])) |
            static_cast<uint64_t>(std::llabs(desc.dst_stride[i]));
    desc.rows *= oe[i];
  }
  desc.word_bytes = WordBytes(bits);
  desc.inner_words = inner_bytes / desc.word_bytes;
  const int64_t tile_words = kTileBytes / desc.word_bytes;
  if (desc.inner_words >= tile_words) {
    desc.rows_per_tile = 1;
    desc.cols_per_tile = tile_words;
    desc.col_tiles = (desc.inner_words + tile_words - 1) / tile_words;
    desc.tiles = desc.rows * desc.col_tiles;
  } else {
    desc.rows_per_tile = tile_words / desc.inner_words;
    desc.cols_per_tile = desc.inner_words;
    desc.col_tiles = 1;
    desc.tiles = (desc.rows + desc.rows_per_tile - 1) / desc.rows_per_tile;
  }
  desc.first_tile = total_tiles_;
  total_tiles_ += desc.tiles;
  bytes_ += inner_bytes * desc.rows;
  descs_.push_back(desc);
}

absl::Status BoxCopyPlan::AddSegments(
    const BucketView& bucket, const std::vector<PackedSegment>& segments,
    size_t first, size_t last, uint8_t* staging, bool pack) {
  if (first >= last) return absl::OkStatus();
  const int64_t origin = segments[first].offset;
  const size_t mark = descs_.size();
  const int64_t tiles_mark = total_tiles_, bytes_mark = bytes_;
  for (size_t i = first; i < last; ++i) {
    const PackedSegment& seg = segments[i];
    const RegionView& region = bucket.regions[seg.box];
    const Dims& extent = bucket.extents[seg.box];
    const int64_t unit = bucket.unit_bytes[seg.box];
    uint8_t* at = staging + (seg.offset - origin);
    const std::string what =
        absl::StrCat("bucket ", bucket.id, " box ", seg.box);
    auto add = [&](uint8_t* region_base, uint8_t* staging_base,
                   const Dims& sub_extent) {
      LocalCopy c;
      RegionView packed{staging_base, RowMajorStrides(sub_extent)};
      RegionView strided{region_base, region.strides};
      c.src = pack ? strided : packed;
      c.dst = pack ? packed : strided;
      c.extent = sub_extent;
      c.unit_bytes = unit;
      return Add(c, what);
    };
    absl::Status s;
    if (seg.unit_begin == 0 && seg.unit_end == Volume(extent)) {
      s = add(region.base, at, extent);
    } else {
      const Dims row_major = RowMajorStrides(extent);
      for (const Box& sub :
           FlatRangeToBoxes(extent, seg.unit_begin, seg.unit_end)) {
        s = add(region.base + Dot(sub.offset, region.strides) * unit,
                at + (Dot(sub.offset, row_major) - seg.unit_begin) * unit,
                sub.extent);
        if (!s.ok()) break;
      }
    }
    if (!s.ok()) {
      descs_.resize(mark);
      total_tiles_ = tiles_mark;
      bytes_ = bytes_mark;
      return s;
    }
  }
  return absl::OkStatus();
}

void BoxCopyPlan::Clear() {
  descs_.clear();
  total_tiles_ = 0;
  bytes_ = 0;
}

void RunPlanOnHost(const BoxCopyPlan& plan, int threads) {
  const std::vector<BoxCopyDesc>& descs = plan.descs();
  const int32_t n = static_cast<int32_t>(descs.size());
  for (int64_t tile = 0; tile < plan.total_tiles(); ++tile) {
    const BoxCopyDesc& d = descs[FindBox(descs.data(), n, tile)];
    for (int t = 0; t < threads; ++t) {
      CopyTileAnyWord(d, tile - d.first_tile, t, threads);
    }
  }
}

}  // namespace gpu
}  // namespace ferry
