// The conformance suite every transport backend passes.
//
// Buckets of random strided boxes (rank 1-5, unit sizes 1, 2, 4, 18 and 144
// bytes, random dim orders, padding and misalignment) are moved from a
// source buffer into a destination buffer by the backend and checked byte
// by byte against an oracle that copies element by element and shares no
// code with core/region_copy or the transports. Bytes outside every box must
// keep their sentinel values: a stray write fails too.
//
// A backend's test file instantiates the suite with one macro:
//
//   FERRY_COPY_ENGINE_CONFORMANCE_TESTS("local", [] { return Create...(); })
//   FERRY_CHANNEL_CONFORMANCE_TESTS("tcp", [] { return ChannelPair{...}; })
//
// Backends that work on GPU memory use the _IN variants with a TestMemory
// that places each bucket's buffers on the device and fetches the result
// back (tests/gpu/device_buffers.h); their cases skip, saying why, where
// TestMemory::Unavailable is not empty (no GPU).
//
// Channel cases run the sender and the receiver on different threads.
// Catch2 assertions are made on the test's own thread only (Catch2 v2 is not
// thread-safe); the sender thread reports a Status.
#ifndef FERRY_TESTS_TRANSPORT_TRANSPORT_CONFORMANCE_H_
#define FERRY_TESTS_TRANSPORT_TRANSPORT_CONFORMANCE_H_

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "core/geometry.h"
#include "transport/transport.h"

namespace ferry {
namespace testing {

inline constexpr int64_t kUnitSizes[] = {1, 2, 4, 8, 18, 144};

// Deterministic from the seed on every platform (unlike std distributions
// across library versions), so two processes build the same buckets.
class TestRng {
 public:
  explicit TestRng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {  // splitmix64
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [lo, hi].
  int64_t Uniform(int64_t lo, int64_t hi) {
    return lo + static_cast<int64_t>(Next() % static_cast<uint64_t>(hi - lo + 1));
  }
  bool OneIn(int n) { return Uniform(0, n - 1) == 0; }

 private:
  uint64_t state_;
};

// One side of a box: where its first unit is (bytes from the buffer start),
// its strides in units, and the span of buffer its layout owns.
struct TestRegion {
  int64_t first_byte = 0;
  Dims strides;
  int64_t area_begin = 0;
  int64_t area_end = 0;
};

struct TestBox {
  Dims extent;
  int64_t unit_bytes = 1;
  TestRegion src;
  TestRegion dst;
};

// A bucket with its own source and destination buffers.
struct TestBucket {
  uint64_t id = 0;
  std::vector<TestBox> boxes;
  std::vector<uint8_t> src;  // host copies: filled, and checked, here
  std::vector<uint8_t> dst;
  // Where the backend sees the buffers when TestMemory placed them
  // elsewhere (device memory); null: the host vectors above.
  uint8_t* placed_src = nullptr;
  uint8_t* placed_dst = nullptr;
  std::shared_ptr<void> placement;  // owns what placed_* point into

  int64_t bytes() const {
    int64_t total = 0;
    for (const TestBox& b : boxes) total += Volume(b.extent) * b.unit_bytes;
    return total;
  }
  // Pseudo-random source bytes, a function of `seed` only.
  void FillSource(uint64_t seed) {
    TestRng rng(seed ^ 0x5EED5EED5EED5EEDull);
    for (size_t i = 0; i < src.size(); i += 8) {
      const uint64_t word = rng.Next();
      std::memcpy(src.data() + i, &word, std::min<size_t>(8, src.size() - i));
    }
  }
  // Position-dependent, so a copy from the wrong place rarely matches it.
  void FillDestinationSentinel() {
    for (size_t i = 0; i < dst.size(); ++i) {
      dst[i] = static_cast<uint8_t>(i * 131 + 7);
    }
  }
  uint8_t* SourceBase() { return placed_src ? placed_src : src.data(); }
  uint8_t* DestinationBase() { return placed_dst ? placed_dst : dst.data(); }

  // One side's view of the boxes in a buffer starting at `base`.
  BucketView View(uint8_t* base, bool source_side) const {
    BucketView view;
    view.id = id;
    for (const TestBox& b : boxes) {
      const TestRegion& r = source_side ? b.src : b.dst;
      view.regions.push_back(RegionView{base + r.first_byte, r.strides});
      view.extents.push_back(b.extent);
      view.unit_bytes.push_back(b.unit_bytes);
    }
    view.bytes = bytes();
    return view;
  }
  BucketView SourceView() { return View(SourceBase(), true); }
  BucketView DestinationView() { return View(DestinationBase(), false); }
  std::vector<LocalCopy> Copies(uint8_t* src_base, uint8_t* dst_base) const {
    std::vector<LocalCopy> copies;
    for (const TestBox& b : boxes) {
      LocalCopy c;
      c.src = RegionView{src_base + b.src.first_byte, b.src.strides};
      c.dst = RegionView{dst_base + b.dst.first_byte, b.dst.strides};
      c.extent = b.extent;
      c.unit_bytes = b.unit_bytes;
      copies.push_back(c);
    }
    return copies;
  }
  std::vector<LocalCopy> LocalCopies() {
    return Copies(SourceBase(), DestinationBase());
  }
};

// Where a backend's buffers live. The host (this class) leaves them in the
// buckets' vectors; a GPU backend's places copies on the device.
class TestMemory {
 public:
  virtual ~TestMemory() = default;
  // "" when the backend can run here; else why not (its cases skip).
  virtual std::string Unavailable() const { return ""; }
  // Gives `b` buffers where the backend works, holding b.src and b.dst.
  virtual void Place(TestBucket& b) { (void)b; }
  // b.src changed on the host: the placed source follows.
  virtual void UpdateSource(TestBucket& b) { (void)b; }
  // The placed destination back into b.dst, for the oracle.
  virtual void Fetch(TestBucket& b) { (void)b; }
};

inline TestMemory& HostMemory() {
  static TestMemory* memory = new TestMemory();
  return *memory;
}

// Builds buckets box by box, each box with its own random layout on both
// sides, laid out one after another in the two buffers.
class TestBucketBuilder {
 public:
  explicit TestBucketBuilder(uint64_t seed) : rng_(seed) {}

  TestRng& rng() { return rng_; }

  // `dense` forces a contiguous row-major layout on both sides (the fast
  // paths); otherwise each side is contiguous one time in four.
  void AddBox(const Dims& extent, int64_t unit_bytes, bool dense = false) {
    TestBox box;
    box.extent = extent;
    box.unit_bytes = unit_bytes;
    box.src = Layout(extent, unit_bytes, dense || rng_.OneIn(4), &src_end_);
    box.dst = Layout(extent, unit_bytes, dense || rng_.OneIn(4), &dst_end_);
    boxes_.push_back(std::move(box));
  }

  // Shard `shard` of `shards` along dim 1 of a [rows, cols] matrix stored
  // row-major in the source, landing in a contiguous [rows, cols/shards]
  // destination: the tensor-parallel row shard.
  void AddRowShard(int64_t rows, int64_t cols, int shards, int shard,
                   int64_t unit) {
    const int64_t width = cols / shards;
    TestBox box;
    box.extent = {rows, width};
    box.unit_bytes = unit;
    box.src.area_begin = src_end_;
    box.src.area_end = src_end_ + rows * cols * unit;
    box.src.strides = {cols, 1};
    box.src.first_byte = box.src.area_begin + shard * width * unit;
    src_end_ = box.src.area_end;
    box.dst.area_begin = dst_end_;
    box.dst.area_end = dst_end_ + rows * width * unit;
    box.dst.strides = {width, 1};
    box.dst.first_byte = box.dst.area_begin;
    dst_end_ = box.dst.area_end;
    boxes_.push_back(std::move(box));
  }

  // A random box: rank 1-5, at most about `max_bytes`.
  void AddRandomBox(int64_t max_bytes = 256 << 10) {
    const int rank = static_cast<int>(rng_.Uniform(1, 5));
    static constexpr int64_t kCap[] = {0, 4096, 96, 20, 9, 6};
    const int64_t unit =
        kUnitSizes[rng_.Uniform(0, std::size(kUnitSizes) - 1)];
    Dims extent;
    for (int i = 0; i < rank; ++i) {
      // Dims of 1 are common in real boxes (a single head, a single row).
      extent.push_back(rng_.OneIn(6) ? 1 : rng_.Uniform(1, kCap[rank]));
    }
    while (Volume(extent) * unit > max_bytes) {
      *std::max_element(extent.begin(), extent.end()) /= 2;
    }
    AddBox(extent, unit);
  }

  TestBucket Build(uint64_t id, uint64_t fill_seed) {
    TestBucket bucket;
    bucket.id = id;
    bucket.boxes = boxes_;
    bucket.src.resize(static_cast<size_t>(src_end_));
    bucket.dst.resize(static_cast<size_t>(dst_end_));
    bucket.FillSource(fill_seed);
    bucket.FillDestinationSentinel();
    return bucket;
  }

 private:
  // Parent dims = extent + padding; memory order a random permutation of
  // the dims; sometimes a gap between dims; a random byte misalignment.
  TestRegion Layout(const Dims& extent, int64_t unit, bool dense,
                    int64_t* cursor) {
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
    TestRegion r;
    r.strides.assign(rank, 0);
    int64_t running = 1;
    for (size_t d : order) {
      r.strides[d] = running;
      running *= parent[d];
      if (!dense && rng_.OneIn(5)) running += rng_.Uniform(1, 3);
    }
    const int64_t misalign = dense ? 0 : rng_.Uniform(0, 7);
    r.area_begin = *cursor + misalign;
    r.area_end = r.area_begin + running * unit;
    int64_t first = 0;
    for (size_t i = 0; i < rank; ++i) first += offset[i] * r.strides[i];
    r.first_byte = r.area_begin + first * unit;
    *cursor = r.area_end;
    return r;
  }

  TestRng rng_;
  std::vector<TestBox> boxes_;
  int64_t src_end_ = 0;
  int64_t dst_end_ = 0;
};

// Calls fn(src_byte, dst_byte, unit_bytes) for every unit of every box,
// row-major, boxes in order: the walk both oracles below share.
template <typename Fn>
void ForEachUnit(const TestBucket& bucket, Fn&& fn) {
  for (const TestBox& box : bucket.boxes) {
    const size_t rank = box.extent.size();
    if (Volume(box.extent) == 0) continue;
    Dims index(rank, 0);
    while (true) {
      int64_t s = box.src.first_byte, d = box.dst.first_byte;
      for (size_t i = 0; i < rank; ++i) {
        s += index[i] * box.src.strides[i] * box.unit_bytes;
        d += index[i] * box.dst.strides[i] * box.unit_bytes;
      }
      fn(s, d, box.unit_bytes);
      size_t k = rank;
      while (k > 0 && ++index[k - 1] == box.extent[k - 1]) {
        index[k - 1] = 0;
        --k;
      }
      if (k == 0) break;
    }
  }
}

// The oracle: what the destination buffer must hold afterwards, computed
// one unit at a time, one byte at a time.
inline std::vector<uint8_t> ExpectedDestination(const TestBucket& bucket) {
  TestBucket fresh;
  fresh.dst.resize(bucket.dst.size());
  fresh.FillDestinationSentinel();
  std::vector<uint8_t> expected = std::move(fresh.dst);
  ForEachUnit(bucket, [&](int64_t s, int64_t d, int64_t unit) {
    for (int64_t b = 0; b < unit; ++b) expected[d + b] = bucket.src[s + b];
  });
  return expected;
}

// The bucket's payload as the wire carries it: every box packed
// row-major, back to back (the sender's staging).
inline std::vector<uint8_t> ExpectedPacked(const TestBucket& bucket) {
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>(bucket.bytes()));
  ForEachUnit(bucket, [&](int64_t s, int64_t, int64_t unit) {
    out.insert(out.end(), bucket.src.begin() + s,
               bucket.src.begin() + s + unit);
  });
  return out;
}

// The first index where two byte strings differ; -1 when equal.
inline int64_t FirstDifference(const std::vector<uint8_t>& a,
                               const std::vector<uint8_t>& b) {
  if (a.size() != b.size()) return 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i] != b[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

// "" when the destination holds what the oracle says; else where it first
// differs, both bytes, how many differ, and which box (if any) owns it.
inline std::string DescribeMismatch(const TestBucket& bucket,
                                    const std::vector<uint8_t>& expected) {
  if (bucket.dst == expected) return "";
  size_t first = 0, count = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    if (bucket.dst[i] != expected[i]) {
      if (count++ == 0) first = i;
    }
  }
  std::string owner = "outside every box (a stray write)";
  for (size_t k = 0; k < bucket.boxes.size(); ++k) {
    const TestBox& b = bucket.boxes[k];
    if (static_cast<int64_t>(first) >= b.dst.area_begin &&
        static_cast<int64_t>(first) < b.dst.area_end) {
      owner = absl::StrCat("in box ", k, " (extent ", DimsToString(b.extent),
                           ", unit ", b.unit_bytes, " bytes, src strides ",
                           DimsToString(b.src.strides), ", dst strides ",
                           DimsToString(b.dst.strides), ")");
    }
  }
  return absl::StrCat("bucket ", bucket.id, ": ", count, " of ",
                      expected.size(), " destination bytes differ; first at ",
                      first, ": expected ", int{expected[first]}, ", got ",
                      int{bucket.dst[first]}, ", ", owner);
}

inline void CheckArrived(const TestBucket& bucket) {
  const std::string mismatch =
      DescribeMismatch(bucket, ExpectedDestination(bucket));
  INFO(mismatch);
  CHECK(mismatch.empty());
}

// --- Bucket recipes shared by every backend. ---

inline TestBucket RandomBucket(uint64_t seed) {
  TestBucketBuilder builder(seed);
  const int boxes = static_cast<int>(builder.rng().Uniform(1, 12));
  for (int i = 0; i < boxes; ++i) builder.AddRandomBox();
  return builder.Build(/*id=*/seed, /*fill_seed=*/seed);
}

// No boxes at all, and boxes with a zero extent.
inline TestBucket EmptyBucket(bool with_empty_boxes) {
  TestBucketBuilder builder(7);
  if (with_empty_boxes) {
    builder.AddBox({0}, 4);
    builder.AddBox({3, 0, 5}, 18);
    builder.AddBox({2, 2}, 2);  // one real box among them
    builder.AddBox({4, 0}, 144);
  }
  return builder.Build(with_empty_boxes ? 2 : 1, 7);
}

// About 38 MiB: a contiguous block, a TP row shard of a bf16 matrix (one
// 4 KiB run per row out of a 4x wider source) and a randomly laid out 3-D
// box of 18-byte units.
inline TestBucket LargeBucket(uint64_t seed) {
  TestBucketBuilder builder(seed);
  builder.AddBox({4 << 20}, 4, /*dense=*/true);  // 16 MiB
  builder.AddRowShard(/*rows=*/2048, /*cols=*/8192, /*shards=*/4,
                      /*shard=*/static_cast<int>(seed % 4), /*unit=*/2);
  builder.AddBox({32, 48, 512}, 18);  // 13.5 MiB
  return builder.Build(seed, seed);
}

// One box of `unit`-byte units and `rank` dims laid out at random, and one
// stored dense: 7 per dim up to rank 3, 3 beyond. Rank 8 strided in every
// dim is more outer dims than a GPU copy descriptor holds (box_copy_plan.h).
inline TestBucket UnitAtRankBucket(uint64_t seed, int64_t unit, int rank) {
  TestBucketBuilder builder(seed);
  Dims extent(rank, rank <= 3 ? 7 : 3);
  builder.AddBox(extent, unit);
  builder.AddBox(extent, unit, /*dense=*/true);
  return builder.Build(seed, seed);
}

// Thousands of boxes of a few units each.
inline TestBucket ManySmallBoxes(uint64_t seed, int boxes = 5000) {
  TestBucketBuilder builder(seed);
  for (int i = 0; i < boxes; ++i) builder.AddRandomBox(/*max_bytes=*/300);
  return builder.Build(seed, seed);
}

// --- CopyEngine cases. ---

using CopyEngineFactory = std::function<std::unique_ptr<CopyEngine>()>;

inline void ExpectCopies(CopyEngine& engine, TestBucket& bucket,
                         TestMemory& memory) {
  memory.Place(bucket);
  const absl::Status s = engine.Run(bucket.LocalCopies());
  INFO(engine.name() << ": " << s.ToString());
  REQUIRE(s.ok());
  memory.Fetch(bucket);
  CheckArrived(bucket);
}

// --- Channel cases. ---

// A connected pair: what `sender` sends, `receiver` receives.
struct ChannelPair {
  std::unique_ptr<Channel> sender;
  std::unique_ptr<Channel> receiver;
  // What the channels run on (an NCCL communicator), if anything: released
  // after them.
  std::shared_ptr<void> keep_alive;

  ChannelPair() = default;
  ChannelPair(ChannelPair&&) = default;
  ChannelPair& operator=(ChannelPair&&) = default;
  ~ChannelPair() {
    sender.reset();
    receiver.reset();
  }
};
using ChannelPairFactory = std::function<ChannelPair()>;

inline absl::Time TestDeadline() { return absl::Now() + absl::Seconds(60); }

// Sends `sent[i]` on a second thread while this thread receives into
// `received[i]` (same layouts); checks every bucket arrived.
inline void ExpectBucketsArrive(ChannelPair& pair,
                                std::vector<TestBucket>& sent,
                                std::vector<TestBucket>& received,
                                TestMemory& memory) {
  for (TestBucket& b : sent) memory.Place(b);
  for (TestBucket& b : received) memory.Place(b);
  absl::Status send_status;
  std::thread sender([&] {
    for (TestBucket& b : sent) {
      send_status = pair.sender->Send(b.SourceView(), TestDeadline());
      if (!send_status.ok()) return;
    }
    send_status = pair.sender->Flush(TestDeadline());
  });
  std::vector<absl::Status> receive_status;
  for (TestBucket& b : received) {
    receive_status.push_back(
        pair.receiver->Receive(b.DestinationView(), TestDeadline()));
    if (!receive_status.back().ok()) break;
  }
  sender.join();
  INFO("send: " << send_status.ToString());
  CHECK(send_status.ok());
  for (size_t i = 0; i < receive_status.size(); ++i) {
    INFO("receive of bucket " << received[i].id << ": "
                              << receive_status[i].ToString());
    CHECK(receive_status[i].ok());
    memory.Fetch(received[i]);
    // The oracle reads the source bytes from the receiver's twin.
    received[i].src = sent[i].src;
    CheckArrived(received[i]);
  }
  CHECK(receive_status.size() == received.size());
}

// Sends bucket `sent` and receives into `received`, which may disagree
// with it; returns the receiver's status.
inline absl::Status ReceiveMismatched(ChannelPair& pair, TestBucket& sent,
                                      TestBucket& received,
                                      TestMemory& memory) {
  memory.Place(sent);
  memory.Place(received);
  absl::Status send_status;
  std::thread sender([&] {
    send_status = pair.sender->Send(sent.SourceView(), TestDeadline());
    if (send_status.ok()) send_status = pair.sender->Flush(TestDeadline());
  });
  const absl::Status status = pair.receiver->Receive(
      received.DestinationView(), absl::Now() + absl::Seconds(20));
  sender.join();
  return status;
}

}  // namespace testing
}  // namespace ferry

// Returns from the test case, saying why, where `memory` is unavailable.
#define FERRY_SKIP_UNLESS_AVAILABLE(memory)                                   \
  do {                                                                        \
    const std::string ferry_why_ = (memory).Unavailable();                    \
    if (!ferry_why_.empty()) {                                                \
      WARN("SKIPPED: " << ferry_why_);                                        \
      std::printf("SKIPPED: %s\n", ferry_why_.c_str());                       \
      return;                                                                 \
    }                                                                         \
  } while (0)

#define FERRY_COPY_ENGINE_CONFORMANCE_TESTS(backend, factory)                 \
  FERRY_COPY_ENGINE_CONFORMANCE_TESTS_IN(backend, factory,                    \
                                         ::ferry::testing::HostMemory())
#define FERRY_CHANNEL_CONFORMANCE_TESTS(backend, factory)                     \
  FERRY_CHANNEL_CONFORMANCE_TESTS_IN(backend, factory,                        \
                                     ::ferry::testing::HostMemory())

// Instantiates the CopyEngine suite. `factory`: () -> unique_ptr<CopyEngine>;
// `memory`: a TestMemory& where the buffers live.
#define FERRY_COPY_ENGINE_CONFORMANCE_TESTS_IN(backend, factory, memory)      \
  TEST_CASE(backend ": random buckets of strided boxes arrive exactly") {     \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    auto engine = (factory)();                                                \
    for (uint64_t seed = 1; seed <= 60; ++seed) {                             \
      INFO("seed " << seed);                                                  \
      ::ferry::testing::TestBucket b = ::ferry::testing::RandomBucket(seed);  \
      ::ferry::testing::ExpectCopies(*engine, b, memory);                             \
    }                                                                         \
  }                                                                           \
  TEST_CASE(backend ": empty buckets and empty boxes") {                      \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    auto engine = (factory)();                                                \
    for (bool boxes : {false, true}) {                                        \
      ::ferry::testing::TestBucket b = ::ferry::testing::EmptyBucket(boxes);  \
      ::ferry::testing::ExpectCopies(*engine, b, memory);                             \
    }                                                                         \
  }                                                                           \
  TEST_CASE(backend ": a large bucket") {                                     \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    auto engine = (factory)();                                                \
    ::ferry::testing::TestBucket b = ::ferry::testing::LargeBucket(11);       \
    ::ferry::testing::ExpectCopies(*engine, b, memory);                               \
  }                                                                           \
  TEST_CASE(backend ": many small boxes") {                                   \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    auto engine = (factory)();                                                \
    ::ferry::testing::TestBucket b = ::ferry::testing::ManySmallBoxes(12);    \
    ::ferry::testing::ExpectCopies(*engine, b, memory);                               \
  }                                                                           \
  TEST_CASE(backend ": concurrent runs share the engine") {                   \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    auto engine = (factory)();                                                \
    std::vector<::ferry::testing::TestBucket> buckets;                        \
    for (uint64_t seed = 100; seed < 104; ++seed) {                           \
      buckets.push_back(::ferry::testing::LargeBucket(seed));                 \
      (memory).Place(buckets.back());                                         \
    }                                                                         \
    std::vector<absl::Status> status(buckets.size());                         \
    std::vector<std::thread> threads;                                         \
    for (size_t i = 0; i < buckets.size(); ++i) {                             \
      threads.emplace_back([&, i] {                                           \
        status[i] = engine->Run(buckets[i].LocalCopies());                    \
      });                                                                     \
    }                                                                         \
    for (std::thread & t : threads) t.join();                                 \
    for (size_t i = 0; i < buckets.size(); ++i) {                             \
      INFO(status[i].ToString());                                             \
      CHECK(status[i].ok());                                                  \
      (memory).Fetch(buckets[i]);                                             \
      ::ferry::testing::CheckArrived(buckets[i]);                             \
    }                                                                         \
  }                                                                           \
  TEST_CASE(backend ": malformed copies are INVALID_ARGUMENT, nothing moves") {\
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    auto engine = (factory)();                                                \
    ::ferry::testing::TestBucket b = ::ferry::testing::RandomBucket(5);       \
    (memory).Place(b);                                                        \
    std::vector<::ferry::LocalCopy> copies = b.LocalCopies();                 \
    copies.push_back(copies.front());                                         \
    copies.back().dst.strides.push_back(1); /* rank mismatch */               \
    const absl::Status s = engine->Run(copies);                               \
    INFO(s.ToString());                                                       \
    CHECK(absl::IsInvalidArgument(s));                                        \
    CHECK(s.message().find("copy " + std::to_string(copies.size() - 1)) !=    \
          std::string::npos);                                                 \
    (memory).Fetch(b);                                                        \
    ::ferry::testing::TestBucket untouched = b;                               \
    untouched.FillDestinationSentinel();                                      \
    CHECK(b.dst == untouched.dst);                                            \
  }

// Instantiates the Channel suite. `factory`: () -> ChannelPair, connected;
// `memory`: a TestMemory& where the buffers live.
#define FERRY_CHANNEL_CONFORMANCE_TESTS_IN(backend, factory, memory)          \
  TEST_CASE(backend ": random buckets of strided boxes arrive exactly") {     \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    std::vector<::ferry::testing::TestBucket> sent, received;                 \
    for (uint64_t seed = 1; seed <= 60; ++seed) {                             \
      sent.push_back(::ferry::testing::RandomBucket(seed));                   \
      received.push_back(::ferry::testing::RandomBucket(seed));               \
    }                                                                         \
    ::ferry::testing::ExpectBucketsArrive(pair, sent, received, memory);              \
  }                                                                           \
  TEST_CASE(backend ": empty buckets and empty boxes") {                      \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    std::vector<::ferry::testing::TestBucket> sent, received;                 \
    for (bool boxes : {false, true, false}) {                                 \
      sent.push_back(::ferry::testing::EmptyBucket(boxes));                   \
      received.push_back(::ferry::testing::EmptyBucket(boxes));               \
    }                                                                         \
    ::ferry::testing::ExpectBucketsArrive(pair, sent, received, memory);              \
  }                                                                           \
  TEST_CASE(backend ": large buckets, pipelined") {                           \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    std::vector<::ferry::testing::TestBucket> sent, received;                 \
    for (uint64_t seed = 11; seed < 14; ++seed) {                             \
      sent.push_back(::ferry::testing::LargeBucket(seed));                    \
      received.push_back(::ferry::testing::LargeBucket(seed));               \
    }                                                                         \
    ::ferry::testing::ExpectBucketsArrive(pair, sent, received, memory);              \
  }                                                                           \
  TEST_CASE(backend ": many small boxes") {                                   \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    std::vector<::ferry::testing::TestBucket> sent, received;                 \
    sent.push_back(::ferry::testing::ManySmallBoxes(12));                     \
    received.push_back(::ferry::testing::ManySmallBoxes(12));                 \
    ::ferry::testing::ExpectBucketsArrive(pair, sent, received, memory);              \
  }                                                                           \
  TEST_CASE(backend ": Send copies the source; it may change on return") {    \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    ::ferry::testing::TestBucket source = ::ferry::testing::RandomBucket(21); \
    (memory).Place(source);                                                   \
    std::vector<::ferry::testing::TestBucket> got;                            \
    for (uint64_t v = 0; v < 8; ++v) {                                        \
      got.push_back(::ferry::testing::RandomBucket(21));                      \
      (memory).Place(got.back());                                             \
    }                                                                         \
    absl::Status send_status;                                                 \
    std::thread sender([&] {                                                  \
      for (uint64_t v = 0; v < 8 && send_status.ok(); ++v) {                  \
        source.FillSource(1000 + v);                                          \
        (memory).UpdateSource(source);                                        \
        ::ferry::BucketView view = source.SourceView();                       \
        view.id = 500 + v;                                                    \
        send_status = pair.sender->Send(view, ::ferry::testing::TestDeadline());\
        source.FillSource(0xBAD); /* scribble right after Send returns */     \
        (memory).UpdateSource(source);                                        \
      }                                                                       \
      if (send_status.ok()) {                                                 \
        send_status = pair.sender->Flush(::ferry::testing::TestDeadline());   \
      }                                                                       \
    });                                                                       \
    std::vector<absl::Status> status;                                         \
    for (uint64_t v = 0; v < 8; ++v) {                                        \
      ::ferry::BucketView view = got[v].DestinationView();                    \
      view.id = 500 + v;                                                      \
      status.push_back(                                                       \
          pair.receiver->Receive(view, ::ferry::testing::TestDeadline()));    \
    }                                                                         \
    sender.join();                                                            \
    INFO(send_status.ToString());                                             \
    REQUIRE(send_status.ok());                                                \
    for (uint64_t v = 0; v < 8; ++v) {                                        \
      INFO("version " << v << ": " << status[v].ToString());                  \
      CHECK(status[v].ok());                                                  \
      (memory).Fetch(got[v]);                                                 \
      got[v].FillSource(1000 + v);                                            \
      ::ferry::testing::CheckArrived(got[v]);                                 \
    }                                                                         \
  }                                                                           \
  TEST_CASE(backend ": a wrong bucket id is DATA_LOSS naming both ids") {     \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    ::ferry::testing::TestBucket sent = ::ferry::testing::RandomBucket(31);   \
    ::ferry::testing::TestBucket expected = ::ferry::testing::RandomBucket(31);\
    sent.id = 7;                                                              \
    expected.id = 8;                                                          \
    const absl::Status s =                                                    \
        ::ferry::testing::ReceiveMismatched(pair, sent, expected, memory);            \
    INFO(s.ToString());                                                       \
    CHECK(absl::IsDataLoss(s));                                               \
    CHECK(s.message().find("bucket 8") != std::string::npos);                 \
    CHECK(s.message().find("bucket 7") != std::string::npos);                 \
    /* The stream is out of step: later calls keep failing. */                \
    CHECK(!pair.receiver->Receive(expected.DestinationView(),                 \
                                  absl::Now() + absl::Milliseconds(50))       \
               .ok());                                                        \
  }                                                                           \
  TEST_CASE(backend ": a wrong bucket size is DATA_LOSS") {                   \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    ::ferry::testing::TestBucket sent = ::ferry::testing::RandomBucket(32);   \
    ::ferry::testing::TestBucket expected = ::ferry::testing::RandomBucket(33);\
    expected.id = sent.id;                                                    \
    REQUIRE(sent.bytes() != expected.bytes());                                \
    const absl::Status s =                                                    \
        ::ferry::testing::ReceiveMismatched(pair, sent, expected, memory);            \
    INFO(s.ToString());                                                       \
    CHECK(absl::IsDataLoss(s));                                               \
  }                                                                           \
  TEST_CASE(backend ": a receive deadline is DEADLINE_EXCEEDED, then usable") {\
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    ::ferry::testing::TestBucket sent = ::ferry::testing::RandomBucket(41);   \
    ::ferry::testing::TestBucket got = ::ferry::testing::RandomBucket(41);    \
    (memory).Place(got);                                                      \
    const absl::Time start = absl::Now();                                     \
    const absl::Status late = pair.receiver->Receive(                         \
        got.DestinationView(), start + absl::Milliseconds(200));              \
    INFO(late.ToString());                                                    \
    CHECK(absl::IsDeadlineExceeded(late));                                    \
    CHECK(absl::Now() - start >= absl::Milliseconds(200));                    \
    CHECK(absl::Now() - start < absl::Seconds(10));                           \
    std::vector<::ferry::testing::TestBucket> s1, r1;                         \
    s1.push_back(std::move(sent));                                            \
    r1.push_back(std::move(got));                                             \
    ::ferry::testing::ExpectBucketsArrive(pair, s1, r1, memory);                      \
  }                                                                           \
  TEST_CASE(backend ": a peer that is gone is UNAVAILABLE") {                 \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    pair.sender.reset();                                                      \
    ::ferry::testing::TestBucket got = ::ferry::testing::RandomBucket(51);    \
    (memory).Place(got);                                                      \
    const absl::Status s = pair.receiver->Receive(                            \
        got.DestinationView(), ::ferry::testing::TestDeadline());             \
    INFO(s.ToString());                                                       \
    CHECK(absl::IsUnavailable(s));                                            \
  }                                                                           \
  TEST_CASE(backend ": malformed buckets are INVALID_ARGUMENT") {             \
    FERRY_SKIP_UNLESS_AVAILABLE(memory);                                      \
    ::ferry::testing::ChannelPair pair = (factory)();                         \
    ::ferry::testing::TestBucket b = ::ferry::testing::RandomBucket(61);      \
    (memory).Place(b);                                                        \
    ::ferry::BucketView view = b.SourceView();                                \
    view.bytes += 1;                                                          \
    CHECK(absl::IsInvalidArgument(                                            \
        pair.sender->Send(view, ::ferry::testing::TestDeadline())));          \
    view = b.DestinationView();                                               \
    view.unit_bytes.pop_back();                                               \
    CHECK(absl::IsInvalidArgument(pair.receiver->Receive(                     \
        view, ::ferry::testing::TestDeadline())));                            \
  }

#endif  // FERRY_TESTS_TRANSPORT_TRANSPORT_CONFORMANCE_H_
