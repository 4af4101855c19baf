// The box copy kernel on a GPU against the host oracle: direct copies,
// pack into staging and unpack from it, for random boxes of rank 1-8 and
// unit sizes 1-144 bytes, aligned and misaligned.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/device.h"
#include "cuda/kernels/box_copier.h"
#include "cuda/kernels/box_copy_plan.h"
#include "tests/gpu/device_buffers.h"
#include "transport/bucket_segments.h"

namespace ferry {
namespace {

using gpu::BoxCopier;
using gpu::BoxCopyPlan;
using gpu_testing::DeviceBucket;
using gpu_testing::DeviceBuffer;

std::unique_ptr<BoxCopier> MakeCopier() {
  absl::StatusOr<std::unique_ptr<BoxCopier>> c = BoxCopier::Create(0);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  return *std::move(c);
}

void CopyAndCheck(BoxCopier& copier, DeviceBucket& b) {
  BoxCopyPlan plan;
  const std::vector<LocalCopy> copies = b.Copies();
  for (size_t i = 0; i < copies.size(); ++i) {
    REQUIRE(plan.Add(copies[i], absl::StrCat("copy ", i)).ok());
  }
  const absl::Status s = copier.Launch(plan, nullptr);
  INFO(s.ToString());
  REQUIRE(s.ok());
  FERRY_CUDA_CHECK(cudaDeviceSynchronize());
  b.CheckArrived();
}

TEST_CASE("kernel: random boxes copy region to region exactly", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  auto copier = MakeCopier();
  for (uint64_t seed = 1; seed <= 60; ++seed) {
    INFO("seed " << seed);
    DeviceBucket b(testing::RandomBucket(seed));
    CopyAndCheck(*copier, b);
  }
}

TEST_CASE("kernel: large, many small and empty boxes", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  auto copier = MakeCopier();
  DeviceBucket large(testing::LargeBucket(5));
  CopyAndCheck(*copier, large);
  DeviceBucket small(testing::ManySmallBoxes(6));
  CopyAndCheck(*copier, small);
  DeviceBucket empty(testing::EmptyBucket(true));
  CopyAndCheck(*copier, empty);
}

TEST_CASE("kernel: pack to staging and unpack, cut in segments", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  auto copier = MakeCopier();
  for (uint64_t seed = 1; seed <= 30; ++seed) {
    for (int64_t max_bytes : {int64_t{1000}, int64_t{64} << 10}) {
      INFO("seed " << seed << ", segments of " << max_bytes);
      DeviceBucket b(testing::RandomBucket(seed));
      const BucketView src = b.SourceView();
      const BucketView dst = b.DestinationView();
      const std::vector<PackedSegment> segs = SplitIntoSegments(src, max_bytes);
      DeviceBuffer staging(static_cast<size_t>(b.host.bytes()));
      // Pack in two launches (two halves of the segments), then unpack in
      // one: the staging offsets must line up either way.
      const size_t half = segs.size() / 2;
      BoxCopyPlan p1, p2, u;
      REQUIRE(p1.AddSegments(src, segs, 0, half, staging.get(), true).ok());
      const int64_t second = half < segs.size() ? segs[half].offset : 0;
      REQUIRE(p2.AddSegments(src, segs, half, segs.size(),
                             staging.get() + second, true)
                  .ok());
      REQUIRE(u.AddSegments(dst, segs, 0, segs.size(), staging.get(), false)
                  .ok());
      REQUIRE(copier->Launch(p1, nullptr).ok());
      REQUIRE(copier->Launch(p2, nullptr).ok());
      FERRY_CUDA_CHECK(cudaDeviceSynchronize());
      CHECK(testing::FirstDifference(
                staging.Download(), testing::ExpectedPacked(b.host)) ==
            -1);
      REQUIRE(copier->Launch(u, nullptr).ok());
      FERRY_CUDA_CHECK(cudaDeviceSynchronize());
      b.CheckArrived();
    }
  }
}

TEST_CASE("kernel: every unit size at every rank", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  auto copier = MakeCopier();
  uint64_t seed = 100;
  for (int64_t unit : testing::kUnitSizes) {
    for (int rank = 1; rank <= 8; ++rank) {
      INFO("unit " << unit << ", rank " << rank);
      DeviceBucket b(testing::UnitAtRankBucket(++seed, unit, rank));
      CopyAndCheck(*copier, b);
    }
  }
}

}  // namespace
}  // namespace ferry
