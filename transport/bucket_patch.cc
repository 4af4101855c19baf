#include "transport/bucket_patch.h"

#include <algorithm>
#include <cstring>

#include "absl/container/inlined_vector.h"
#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

constexpr uint8_t kBitmapForm = 1;
constexpr uint8_t kIndexForm = 2;
constexpr int64_t kBoxHeaderBytes = 1 + 8;

int64_t BoxBytes(const BucketView& b, size_t k) {
  int64_t units = 1;
  for (int64_t e : b.extents[k]) units *= e;
  return units * b.unit_bytes[k];
}

// Calls fn(run, bytes) for each contiguous run of box k in packed
// (row-major) order: trailing dims that are contiguous in the region are
// one run.
template <typename Fn>
void ForEachRun(const BucketView& b, size_t k, Fn&& fn) {
  const Dims& extent = b.extents[k];
  const Dims& strides = b.regions[k].strides;
  const int64_t unit = b.unit_bytes[k];
  const int n = static_cast<int>(extent.size());
  for (int64_t e : extent) {
    if (e == 0) return;
  }
  if (n == 0) {
    fn(b.regions[k].base, unit);
    return;
  }
  int outer = n - 1;  // dims [0, outer) are iterated
  int64_t span = 1;   // units in one run
  if (strides[n - 1] == 1) {
    span = extent[n - 1];
    outer = n - 1;
    while (outer > 0 && strides[outer - 1] == span) {
      --outer;
      span *= extent[outer];
    }
  } else {
    outer = n;
  }
  absl::InlinedVector<int64_t, 8> idx(outer, 0);  // no heap: runs guarded
  while (true) {
    int64_t offset = 0;
    for (int d = 0; d < outer; ++d) offset += idx[d] * strides[d];
    fn(b.regions[k].base + offset * unit, span * unit);
    int d = outer - 1;
    while (d >= 0 && ++idx[d] == extent[d]) idx[d--] = 0;
    if (d < 0) return;
  }
}

// Bits [pos, pos + k) of `src`, k <= 64, in the low bits.
uint64_t Extract(const uint64_t* src, int64_t pos, int k) {
  const int shift = static_cast<int>(pos & 63);
  uint64_t w = src[pos >> 6] >> shift;
  if (shift != 0 && shift + k > 64) w |= src[(pos >> 6) + 1] << (64 - shift);
  return k == 64 ? w : w & ((uint64_t{1} << k) - 1);
}

// ORs bits [spos, spos + len) of `src` into `dst` at bit `dpos`.
void CopyBits(const uint64_t* src, int64_t spos, uint64_t* dst, int64_t dpos,
              int64_t len) {
  while (len > 0) {
    const int room = 64 - static_cast<int>(dpos & 63);
    const int k = static_cast<int>(std::min<int64_t>(room, len));
    dst[dpos >> 6] |= Extract(src, spos, k) << (dpos & 63);
    spos += k;
    dpos += k;
    len -= k;
  }
}

// Calls fn(j) for each set bit j of `bits` in [begin, end), ascending.
template <typename Fn>
void ForEachSetBit(const uint64_t* bits, int64_t begin, int64_t end, Fn&& fn) {
  for (int64_t w = begin >> 6; (w << 6) < end; ++w) {
    uint64_t word = bits[w];
    if (word == 0) continue;
    const int64_t base = w << 6;
    if (base < begin) word &= ~uint64_t{0} << (begin - base);
    if (base + 64 > end) word &= (uint64_t{1} << (end - base)) - 1;
    while (word != 0) {
      fn(base + __builtin_ctzll(word));
      word &= word - 1;
    }
  }
}

void PutU64(uint8_t* out, uint64_t v) { std::memcpy(out, &v, 8); }
uint64_t GetU64(const uint8_t* in) {
  uint64_t v;
  std::memcpy(&v, in, 8);
  return v;
}

}  // namespace

bool Patchable(const BucketView& bucket,
               const std::vector<const uint8_t*>& buffer_bases) {
  if (buffer_bases.size() != bucket.regions.size()) return false;
  for (size_t k = 0; k < bucket.regions.size(); ++k) {
    if (buffer_bases[k] == nullptr || bucket.unit_bytes[k] % kPatchChunkBytes != 0 ||
        (bucket.regions[k].base - buffer_bases[k]) % kPatchChunkBytes != 0) {
      return false;
    }
  }
  return true;
}

PatchPlan PlanPatch(const BucketView& source,
                    const std::vector<ChunkChanges>& changes, int64_t limit) {
  PatchPlan plan;
  const size_t boxes = source.regions.size();
  plan.packed.resize(boxes);
  plan.counts.assign(boxes, 0);
  plan.forms.assign(boxes, kBitmapForm);
  for (size_t k = 0; k < boxes; ++k) {
    const int64_t chunks = BoxBytes(source, k) / kPatchChunkBytes;
    std::vector<uint64_t>& packed = plan.packed[k];
    packed.assign((chunks + 63) / 64, 0);
    int64_t pos = 0;
    ForEachRun(source, k, [&](const uint8_t* run, int64_t bytes) {
      const int64_t first = (run - changes[k].buffer_base) / kPatchChunkBytes;
      CopyBits(changes[k].bits, first, packed.data(), pos,
               bytes / kPatchChunkBytes);
      pos += bytes / kPatchChunkBytes;
    });
    for (uint64_t w : packed) plan.counts[k] += __builtin_popcountll(w);
    const int64_t bitmap = (chunks + 7) / 8;
    const int64_t index = chunks <= (int64_t{1} << 32) ? 4 * plan.counts[k]
                                                       : bitmap + 1;
    plan.forms[k] = index < bitmap ? kIndexForm : kBitmapForm;
    plan.bytes += kBoxHeaderBytes + std::min(index, bitmap) +
                  kPatchChunkBytes * plan.counts[k];
    plan.changed_chunks += plan.counts[k];
    if (plan.bytes >= limit) return plan;  // dense
  }
  plan.dense = false;
  return plan;
}

void WritePatch(const BucketView& source, const PatchPlan& plan,
                uint8_t* out) {
  uint8_t* p = out;
  for (size_t k = 0; k < source.regions.size(); ++k) {
    const int64_t chunks = BoxBytes(source, k) / kPatchChunkBytes;
    const uint64_t* packed = plan.packed[k].data();
    *p++ = plan.forms[k];
    PutU64(p, plan.counts[k]);
    p += 8;
    if (plan.forms[k] == kBitmapForm) {
      const int64_t bitmap = (chunks + 7) / 8;
      if (bitmap > 0) std::memcpy(p, packed, bitmap);  // little-endian words
      p += bitmap;
    } else {
      ForEachSetBit(packed, 0, chunks, [&](int64_t j) {
        const uint32_t i = static_cast<uint32_t>(j);
        std::memcpy(p, &i, 4);
        p += 4;
      });
    }
    int64_t pos = 0;
    ForEachRun(source, k, [&](const uint8_t* run, int64_t bytes) {
      const int64_t len = bytes / kPatchChunkBytes;
      ForEachSetBit(packed, pos, pos + len, [&](int64_t j) {
        std::memcpy(p, run + (j - pos) * kPatchChunkBytes, kPatchChunkBytes);
        p += kPatchChunkBytes;
      });
      pos += len;
    });
  }
}

absl::StatusOr<ParsedPatch> ParsePatch(const BucketView& destination,
                                       const uint8_t* patch, int64_t bytes,
                                       const std::string& what) {
  int64_t at = 0;
  auto bad = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(what, ": patch ", why, " (at byte ",
                                            at, " of ", bytes, ")"));
  };
  ParsedPatch parsed;
  parsed.boxes.resize(destination.regions.size());
  for (size_t k = 0; k < destination.regions.size(); ++k) {
    ParsedPatch::Box& box = parsed.boxes[k];
    const int64_t box_bytes = BoxBytes(destination, k);
    if (box_bytes % kPatchChunkBytes != 0) return bad("for a box of odd bytes");
    const int64_t chunks = box_bytes / kPatchChunkBytes;
    if (bytes - at < kBoxHeaderBytes) {
      return bad(absl::StrCat("ends before box ", k));
    }
    box.form = patch[at];
    const uint64_t n = GetU64(patch + at + 1);
    at += kBoxHeaderBytes;
    if (n > static_cast<uint64_t>(chunks)) {
      return bad(absl::StrCat("changes ", n, " chunks of box ", k, "'s ",
                              chunks));
    }
    box.count = static_cast<int64_t>(n);
    const int64_t values_bytes = box.count * kPatchChunkBytes;
    if (box.form == kBitmapForm) {
      const int64_t bitmap = (chunks + 7) / 8;
      if (bytes - at < bitmap + values_bytes) return bad("is cut short");
      box.bits.assign((chunks + 63) / 64, 0);
      if (bitmap > 0) std::memcpy(box.bits.data(), patch + at, bitmap);
      at += bitmap;
      if (chunks % 64 != 0 && (box.bits.back() >> (chunks % 64)) != 0) {
        return bad(absl::StrCat("marks chunks past box ", k, "'s end"));
      }
      int64_t set = 0;
      for (uint64_t w : box.bits) set += __builtin_popcountll(w);
      if (set != box.count) return bad("bitmap disagrees with its count");
    } else if (box.form == kIndexForm) {
      if ((bytes - at) / 6 < box.count) return bad("is cut short");
      box.index_at = at;
      uint32_t previous = 0;
      for (int64_t i = 0; i < box.count; ++i) {
        uint32_t index;
        std::memcpy(&index, patch + at + 4 * i, 4);
        if (index >= chunks || (i > 0 && index <= previous)) {
          return bad(absl::StrCat("index ", index, " of box ", k,
                                  " is out of order or past its ", chunks,
                                  " chunks"));
        }
        previous = index;
      }
      at += 4 * box.count;
    } else {
      return bad(absl::StrCat("has form ", int{box.form}, " for box ", k));
    }
    box.values_at = at;
    at += values_bytes;
  }
  if (at != bytes) return bad("is longer than its boxes");
  return parsed;
}

void ApplyPatch(const BucketView& destination, const ParsedPatch& parsed,
                const uint8_t* patch) {
  for (size_t k = 0; k < destination.regions.size(); ++k) {
    const ParsedPatch::Box& box = parsed.boxes[k];
    const uint8_t* values = patch + box.values_at;
    int64_t pos = 0;
    if (box.form == kBitmapForm) {
      ForEachRun(destination, k, [&](uint8_t* run, int64_t run_bytes) {
        const int64_t len = run_bytes / kPatchChunkBytes;
        ForEachSetBit(box.bits.data(), pos, pos + len, [&](int64_t j) {
          std::memcpy(run + (j - pos) * kPatchChunkBytes, values,
                      kPatchChunkBytes);
          values += kPatchChunkBytes;
        });
        pos += len;
      });
      continue;
    }
    const uint8_t* index = patch + box.index_at;
    int64_t next = 0;
    ForEachRun(destination, k, [&](uint8_t* run, int64_t run_bytes) {
      const int64_t len = run_bytes / kPatchChunkBytes;
      for (; next < box.count; ++next) {
        uint32_t j;
        std::memcpy(&j, index + 4 * next, 4);
        if (j >= pos + len) break;
        std::memcpy(run + (j - pos) * kPatchChunkBytes, values,
                    kPatchChunkBytes);
        values += kPatchChunkBytes;
      }
      pos += len;
    });
  }
}

}  // namespace ferry
