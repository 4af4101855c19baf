// The host logic of the GPU backends, on any machine: the box copy plan
// run through the kernel's own tile loop on the CPU (RunPlanOnHost), pack
// and unpack by segments, and the IPC registration cache behind a fake
// mapper that counts opens.
#include <catch2/catch.hpp>

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/ipc/ipc_memory_cache.h"
#include "cuda/kernels/box_copy_plan.h"
#include "tests/transport/transport_conformance.h"
#include "transport/bucket_segments.h"

namespace ferry {
namespace {

using gpu::BoxCopyPlan;
using testing::TestBucket;

// Copies the bucket box by box through one plan, on the CPU.
void CopyOnHost(TestBucket& b, int threads) {
  BoxCopyPlan plan;
  const std::vector<LocalCopy> copies = b.Copies(b.src.data(), b.dst.data());
  for (size_t i = 0; i < copies.size(); ++i) {
    REQUIRE(plan.Add(copies[i], absl::StrCat("copy ", i)).ok());
  }
  CHECK(plan.bytes() == b.bytes());
  gpu::RunPlanOnHost(plan, threads);
}

TEST_CASE("box copy plan: random boxes land exactly, through the kernel loop") {
  for (uint64_t seed = 1; seed <= 80; ++seed) {
    INFO("seed " << seed);
    TestBucket b = testing::RandomBucket(seed);
    CopyOnHost(b, seed % 2 == 0 ? 256 : 7);  // 7: ragged thread strides
    CHECK(testing::FirstDifference(b.dst,
                                       testing::ExpectedDestination(b)) ==
          -1);
  }
}

TEST_CASE("box copy plan: large, many small and empty boxes") {
  for (TestBucket b : {testing::LargeBucket(3),
                       testing::ManySmallBoxes(4, 2000),
                       testing::EmptyBucket(true)}) {
    INFO("bucket " << b.id);
    CopyOnHost(b, 256);
    CHECK(testing::FirstDifference(b.dst,
                                       testing::ExpectedDestination(b)) ==
          -1);
  }
}

TEST_CASE("box copy plan: pack and unpack by segments, any cut") {
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    for (int64_t max_bytes : {int64_t{1000}, int64_t{1} << 20}) {
      INFO("seed " << seed << ", segments of " << max_bytes);
      TestBucket b = testing::RandomBucket(seed);
      const BucketView src = b.View(b.src.data(), true);
      const BucketView dst = b.View(b.dst.data(), false);
      REQUIRE(ValidateBucketView(src).ok());
      const std::vector<PackedSegment> segs = SplitIntoSegments(src, max_bytes);
      std::vector<uint8_t> packed(static_cast<size_t>(b.bytes()));
      // Pack and unpack one segment at a time, each at its own offset.
      for (size_t i = 0; i < segs.size(); ++i) {
        BoxCopyPlan pack, unpack;
        REQUIRE(pack.AddSegments(src, segs, i, i + 1,
                                 packed.data() + segs[i].offset, true)
                    .ok());
        gpu::RunPlanOnHost(pack);
        REQUIRE(unpack.AddSegments(dst, segs, i, i + 1,
                                   packed.data() + segs[i].offset, false)
                    .ok());
        gpu::RunPlanOnHost(unpack);
      }
      CHECK(testing::FirstDifference(packed,
                                         testing::ExpectedPacked(b)) == -1);
      CHECK(testing::FirstDifference(
                b.dst, testing::ExpectedDestination(b)) == -1);
    }
  }
}

TEST_CASE("box copy plan: coalescing and word widths") {
  alignas(16) static uint8_t src[1 << 16], dst[1 << 16];
  BoxCopyPlan plan;
  // A bf16 row shard [64, 256] of a [64, 1024] matrix: one run per row,
  // 512 bytes, moved as 16-byte words.
  LocalCopy shard{{src, {1024, 1}}, {dst, {256, 1}}, {64, 256}, 2};
  REQUIRE(plan.Add(shard, "shard").ok());
  // A whole contiguous 3-D tensor: a single run.
  LocalCopy whole{{src, {64, 8, 1}}, {dst, {64, 8, 1}}, {4, 8, 8}, 4};
  REQUIRE(plan.Add(whole, "whole").ok());
  // 18-byte GGUF blocks at an odd address: byte words.
  LocalCopy gguf{{src + 1, {40, 1}}, {dst, {20, 1}}, {10, 20}, 18};
  REQUIRE(plan.Add(gguf, "gguf").ok());
  const auto& d = plan.descs();
  REQUIRE(d.size() == 3);
  CHECK(d[0].outer_rank == 1);
  CHECK(d[0].rows == 64);
  CHECK(d[0].word_bytes == 16);
  CHECK(d[0].inner_words == 32);
  CHECK(d[1].outer_rank == 0);
  CHECK(d[1].inner_words * d[1].word_bytes == 4 * 8 * 8 * 4);
  CHECK(d[2].word_bytes == 1);
  CHECK(d[2].inner_words == 20 * 18);
  CHECK(d[1].first_tile == d[0].tiles);
  CHECK(plan.total_tiles() == d[0].tiles + d[1].tiles + d[2].tiles);
}

TEST_CASE("box copy plan: malformed copies are INVALID_ARGUMENT") {
  alignas(16) static uint8_t buf[1 << 12];
  BoxCopyPlan plan;
  LocalCopy bad{{buf, {1}}, {buf, {2, 1}}, {2}, 4};
  absl::Status s = plan.Add(bad, "copy 3");
  CHECK(absl::IsInvalidArgument(s));
  CHECK(s.message().find("copy 3") != std::string::npos);
  CHECK(plan.empty());
  // An empty box adds nothing and is fine without an address.
  LocalCopy empty{{nullptr, {1, 1}}, {nullptr, {1, 1}}, {0, 3}, 2};
  CHECK(plan.Add(empty, "empty").ok());
  CHECK(plan.empty());
}

// Found on the first GPU run (H200): a box of rank 8 whose every dim is
// strided keeps 8 outer dims, one more than a descriptor holds; Add
// refused it, so such a plan failed on GPUs only. It is now split along
// its outermost dim.
TEST_CASE("box copy plan: a box with more strided dims than a descriptor "
          "holds lands exactly") {
  alignas(16) static uint8_t src[1 << 14];
  alignas(16) static uint8_t dst[1 << 14];
  for (size_t i = 0; i < sizeof src; ++i) src[i] = static_cast<uint8_t>(i * 31 + 7);
  // Nine dims of 2, the source padded so that no two dims merge: 8
  // strided outer dims after the innermost run.
  LocalCopy deep;
  deep.unit_bytes = 1;
  int64_t stride = 1;
  for (int i = 0; i < 9; ++i) {
    deep.extent.insert(deep.extent.begin(), 2);
    deep.src.strides.insert(deep.src.strides.begin(), stride);
    stride *= 3;
  }
  deep.dst.strides = RowMajorStrides(deep.extent);
  deep.src.base = src;
  deep.dst.base = dst;
  BoxCopyPlan plan;
  const absl::Status s = plan.Add(deep, "deep");
  INFO(s.ToString());
  REQUIRE(s.ok());
  CHECK(plan.descs().size() == 2);  // one per index of the outermost dim
  CHECK(plan.bytes() == 512);
  gpu::RunPlanOnHost(plan, 7);
  for (int64_t flat = 0; flat < 512; ++flat) {
    int64_t at = 0, rest = flat;
    for (int d = 8; d >= 0; --d) {
      at += (rest % 2) * deep.src.strides[d];
      rest /= 2;
    }
    INFO("element " << flat);
    REQUIRE(dst[flat] == src[at]);
  }
}

TEST_CASE("box copy plan: every unit size at every rank, on the host") {
  uint64_t seed = 100;
  for (int64_t unit : testing::kUnitSizes) {
    for (int rank = 1; rank <= 8; ++rank) {
      INFO("unit " << unit << ", rank " << rank);
      TestBucket b = testing::UnitAtRankBucket(++seed, unit, rank);
      CopyOnHost(b, 256);
      CHECK(testing::FirstDifference(b.dst, testing::ExpectedDestination(b)) == -1);
    }
  }
}

// --- IPC registration cache. ---

class CountingMapper : public gpu::IpcMapper {
 public:
  explicit CountingMapper(std::map<std::string, int>* log) : log_(log) {}
  absl::StatusOr<uint8_t*> Open(int device, absl::string_view handle) override {
    ++(*log_)["open"];
    if (handle[0] == 'X') return absl::InternalError("cannot open");
    return reinterpret_cast<uint8_t*>(0x1000 * (handle[0] + 16 * device));
  }
  absl::Status Close(int, uint8_t*) override {
    ++(*log_)["close"];
    return absl::OkStatus();
  }

 private:
  std::map<std::string, int>* log_;
};

std::string Handle(char c) { return std::string(gpu::kCudaIpcHandleBytes, c); }

TEST_CASE("ipc cache: each allocation is opened once, closed with the last reference") {
  std::map<std::string, int> log;
  {
    gpu::IpcMemoryCache cache(std::make_unique<CountingMapper>(&log));
    // A thousand tensors in two allocations: two opens.
    for (int i = 0; i < 1000; ++i) {
      absl::StatusOr<uint8_t*> a = cache.Register(0, Handle(i % 2 ? 'a' : 'b'));
      REQUIRE(a.ok());
    }
    CHECK(log["open"] == 2);
    CHECK(cache.opens() == 2);
    CHECK(cache.size() == 2);
    // The same allocation on another device is another mapping.
    absl::StatusOr<uint8_t*> other = cache.Register(1, Handle('a'));
    REQUIRE(other.ok());
    CHECK(*other != *cache.Register(0, Handle('a')));
    CHECK(cache.opens() == 3);
    // References: 'b' on device 0 holds 500.
    for (int i = 0; i < 499; ++i) REQUIRE(cache.Deregister(0, Handle('b')).ok());
    CHECK(log["close"] == 0);
    REQUIRE(cache.Deregister(0, Handle('b')).ok());
    CHECK(log["close"] == 1);
    CHECK(absl::IsNotFound(cache.Deregister(0, Handle('b'))));
    // Errors are returned and not cached; short handles are refused.
    CHECK(absl::IsInternal(cache.Register(0, Handle('X')).status()));
    CHECK(cache.size() == 2);
    CHECK(absl::IsInvalidArgument(cache.Register(0, "short").status()));
  }
  // The cache closed what was still open.
  CHECK(log["close"] == 3);
}

}  // namespace
}  // namespace ferry
