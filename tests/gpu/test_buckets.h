// Random buckets of strided boxes for the GPU tests, with an oracle.
//
// Like tests/transport/transport_conformance.h (whose suite runs on host
// buffers): boxes of rank 1-8 and unit sizes 1, 2, 4, 8, 18 and 144 bytes,
// each side with its own padding, dim order, gaps and byte misalignment,
// laid out one after another in a source and a destination buffer. The
// oracle copies one unit at a time, one byte at a time, and shares no code
// with cuda/. Plain C++: the buffers here are host memory; the GPU tests
// mirror them on the device (device_buffers.h).
#ifndef FERRY_TESTS_GPU_TEST_BUCKETS_H_
#define FERRY_TESTS_GPU_TEST_BUCKETS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "core/geometry.h"
#include "daemon/transport/transport.h"

namespace ferry {
namespace gpu_testing {

inline constexpr int64_t kUnitSizes[] = {1, 2, 4, 8, 18, 144};

class Rng {  // splitmix64: the same sequence everywhere
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t Uniform(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool OneIn(int n) { return Uniform(0, n - 1) == 0; }

 private:
  uint64_t state_;
};

struct Side {
  int64_t first_byte = 0;  // of the box's first unit, from the buffer start
  Dims strides;            // units
};

struct TestBox {
  Dims extent;
  int64_t unit_bytes = 1;
  Side src, dst;
};

struct TestBucket {
  uint64_t id = 0;
  std::vector<TestBox> boxes;
  std::vector<uint8_t> src, dst;

  int64_t bytes() const {
    int64_t total = 0;
    for (const TestBox& b : boxes) total += Volume(b.extent) * b.unit_bytes;
    return total;
  }
  void FillSource(uint64_t seed) {
    Rng rng(seed ^ 0x5EED5EED5EED5EEDull);
    for (size_t i = 0; i < src.size(); i += 8) {
      const uint64_t w = rng.Next();
      std::memcpy(src.data() + i, &w, std::min<size_t>(8, src.size() - i));
    }
  }
  void FillDestinationSentinel() {
    for (size_t i = 0; i < dst.size(); ++i) dst[i] = static_cast<uint8_t>(i * 131 + 7);
  }
  // Views with the given buffer bases (host here, device in GPU tests).
  BucketView View(uint8_t* base, bool source_side) const {
    BucketView v;
    v.id = id;
    for (const TestBox& b : boxes) {
      const Side& s = source_side ? b.src : b.dst;
      v.regions.push_back(RegionView{base + s.first_byte, s.strides});
      v.extents.push_back(b.extent);
      v.unit_bytes.push_back(b.unit_bytes);
    }
    v.bytes = bytes();
    return v;
  }
  std::vector<LocalCopy> Copies(uint8_t* src_base, uint8_t* dst_base) const {
    std::vector<LocalCopy> out;
    for (const TestBox& b : boxes) {
      LocalCopy c;
      c.src = RegionView{src_base + b.src.first_byte, b.src.strides};
      c.dst = RegionView{dst_base + b.dst.first_byte, b.dst.strides};
      c.extent = b.extent;
      c.unit_bytes = b.unit_bytes;
      out.push_back(c);
    }
    return out;
  }
};

// Calls fn(src_byte, dst_byte, packed_byte) for every unit, row-major.
template <typename Fn>
void ForEachUnit(const TestBucket& b, Fn&& fn) {
  int64_t packed = 0;
  for (const TestBox& box : b.boxes) {
    if (Volume(box.extent) == 0) continue;
    const size_t rank = box.extent.size();
    Dims index(rank, 0);
    while (true) {
      int64_t s = box.src.first_byte, d = box.dst.first_byte;
      for (size_t i = 0; i < rank; ++i) {
        s += index[i] * box.src.strides[i] * box.unit_bytes;
        d += index[i] * box.dst.strides[i] * box.unit_bytes;
      }
      fn(s, d, packed, box.unit_bytes);
      packed += box.unit_bytes;
      size_t k = rank;
      while (k > 0 && ++index[k - 1] == box.extent[k - 1]) index[--k] = 0;
      if (k == 0) break;
    }
  }
}

// The destination after the bucket's copies, starting from the sentinel.
inline std::vector<uint8_t> ExpectedDestination(const TestBucket& b) {
  TestBucket t = b;
  t.FillDestinationSentinel();
  ForEachUnit(b, [&](int64_t s, int64_t d, int64_t, int64_t unit) {
    for (int64_t i = 0; i < unit; ++i) t.dst[d + i] = b.src[s + i];
  });
  return t.dst;
}

// The payload: every box packed row-major, back to back.
inline std::vector<uint8_t> ExpectedPacked(const TestBucket& b) {
  std::vector<uint8_t> out(static_cast<size_t>(b.bytes()));
  ForEachUnit(b, [&](int64_t s, int64_t, int64_t p, int64_t unit) {
    for (int64_t i = 0; i < unit; ++i) out[p + i] = b.src[s + i];
  });
  return out;
}

// First differing byte, or -1.
inline int64_t FirstDifference(const std::vector<uint8_t>& a,
                               const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

class BucketBuilder {
 public:
  explicit BucketBuilder(uint64_t seed) : rng_(seed) {}

  void AddBox(const Dims& extent, int64_t unit, bool dense = false) {
    TestBox box;
    box.extent = extent;
    box.unit_bytes = unit;
    box.src = Layout(extent, unit, dense || rng_.OneIn(4), &src_end_);
    box.dst = Layout(extent, unit, dense || rng_.OneIn(4), &dst_end_);
    boxes_.push_back(std::move(box));
  }
  // Row shard `shard` of `shards` (dim 1) of a row-major [rows, cols].
  void AddRowShard(int64_t rows, int64_t cols, int shards, int shard,
                   int64_t unit) {
    const int64_t width = cols / shards;
    TestBox box;
    box.extent = {rows, width};
    box.unit_bytes = unit;
    box.src.strides = {cols, 1};
    box.src.first_byte = src_end_ + shard * width * unit;
    src_end_ += rows * cols * unit;
    box.dst.strides = {width, 1};
    box.dst.first_byte = dst_end_;
    dst_end_ += rows * width * unit;
    boxes_.push_back(std::move(box));
  }
  // Rank 1-8, at most about `max_bytes`.
  void AddRandomBox(int64_t max_bytes) {
    const int rank = static_cast<int>(rng_.Uniform(1, 8));
    static constexpr int64_t kCap[] = {0, 4096, 96, 20, 9, 6, 4, 3, 3};
    const int64_t unit = kUnitSizes[rng_.Uniform(0, 5)];
    Dims extent;
    for (int i = 0; i < rank; ++i) {
      extent.push_back(rng_.OneIn(6) ? 1 : rng_.Uniform(1, kCap[rank]));
    }
    while (Volume(extent) * unit > max_bytes) {
      *std::max_element(extent.begin(), extent.end()) /= 2;
    }
    AddBox(extent, unit);
  }
  TestBucket Build(uint64_t id, uint64_t fill_seed) {
    TestBucket b;
    b.id = id;
    b.boxes = boxes_;
    // 16 spare bytes so that misaligned layouts never run off the end.
    b.src.resize(static_cast<size_t>(src_end_ + 16));
    b.dst.resize(static_cast<size_t>(dst_end_ + 16));
    b.FillSource(fill_seed);
    b.FillDestinationSentinel();
    return b;
  }

 private:
  Side Layout(const Dims& extent, int64_t unit, bool dense, int64_t* cursor) {
    const size_t rank = extent.size();
    Dims parent = extent, offset(rank, 0);
    std::vector<size_t> order(rank);  // innermost first
    for (size_t i = 0; i < rank; ++i) order[i] = rank - 1 - i;
    if (!dense) {
      for (size_t i = 0; i < rank; ++i) {
        const int64_t pad = rng_.OneIn(2) ? 0 : rng_.Uniform(1, 3);
        parent[i] += pad;
        offset[i] = rng_.Uniform(0, pad);
      }
      if (rng_.OneIn(2)) {
        for (size_t i = rank; i > 1; --i) {
          std::swap(order[i - 1], order[rng_.Uniform(0, i - 1)]);
        }
      }
    }
    Side s;
    s.strides.assign(rank, 0);
    int64_t running = 1;
    for (size_t d : order) {
      s.strides[d] = running;
      running *= parent[d];
      if (!dense && rng_.OneIn(5)) running += rng_.Uniform(1, 3);
    }
    // Dense boxes start 16-byte aligned (the vector fast path); others
    // at a random byte offset.
    *cursor = (*cursor + 15) / 16 * 16;
    const int64_t begin = *cursor + (dense ? 0 : rng_.Uniform(0, 7));
    int64_t first = 0;
    for (size_t i = 0; i < rank; ++i) first += offset[i] * s.strides[i];
    s.first_byte = begin + first * unit;
    *cursor = begin + running * unit;
    return s;
  }

  Rng rng_;
  std::vector<TestBox> boxes_;
  int64_t src_end_ = 0, dst_end_ = 0;
};

inline TestBucket RandomBucket(uint64_t seed, int boxes = 12,
                               int64_t max_box_bytes = 256 << 10) {
  BucketBuilder b(seed);
  for (int i = 0; i < boxes; ++i) b.AddRandomBox(max_box_bytes);
  return b.Build(seed, seed);
}

// About 38 MiB: dense fp32, a bf16 TP row shard, a 3-D box of 18-byte units.
inline TestBucket LargeBucket(uint64_t seed) {
  BucketBuilder b(seed);
  b.AddBox({4 << 20}, 4, /*dense=*/true);
  b.AddRowShard(2048, 8192, 4, static_cast<int>(seed % 4), 2);
  b.AddBox({32, 48, 512}, 18);
  return b.Build(seed, seed);
}

inline TestBucket ManySmallBoxes(uint64_t seed, int boxes = 5000) {
  BucketBuilder b(seed);
  for (int i = 0; i < boxes; ++i) b.AddRandomBox(300);
  return b.Build(seed, seed);
}

inline TestBucket EmptyBoxes() {
  BucketBuilder b(7);
  b.AddBox({0}, 4);
  b.AddBox({3, 0, 5}, 18);
  b.AddBox({2, 2}, 2);
  b.AddBox({4, 0}, 144);
  return b.Build(2, 7);
}

}  // namespace gpu_testing
}  // namespace ferry

#endif  // FERRY_TESTS_GPU_TEST_BUCKETS_H_
