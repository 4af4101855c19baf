// A bucket's patch (transport/bucket_patch.h): random strided boxes of
// even units (the conformance suite's buckets), a previous version in the
// destination, a new one in the source that differs in a chosen fraction
// of 2-byte chunks; the patch, planned from bits computed here chunk by
// chunk (not by the product's diff), written, parsed and applied, must
// leave the destination equal to the conformance oracle's expectation of
// the new source, bytes outside the boxes untouched. Malformed patches are
// DATA_LOSS and never crash.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "tests/transport/transport_conformance.h"
#include "transport/bucket_patch.h"

namespace ferry {
namespace {

using testing::ExpectedDestination;
using testing::TestBucket;
using testing::TestBucketBuilder;
using testing::TestRng;

// A bucket of 1-3 boxes of even units whose every box starts on an even
// byte of the source buffer; false when this seed's layout does not.
bool EvenBucket(uint64_t seed, TestBucket* out) {
  TestBucketBuilder b(seed);
  const int boxes = static_cast<int>(b.rng().Uniform(1, 3));
  static constexpr int64_t kEvenUnits[] = {2, 4, 8, 18, 144};
  for (int i = 0; i < boxes; ++i) {
    const int rank = static_cast<int>(b.rng().Uniform(1, 3));
    Dims extent;
    for (int d = 0; d < rank; ++d) extent.push_back(b.rng().Uniform(1, 24));
    b.AddBox(extent, kEvenUnits[b.rng().Uniform(0, 4)], b.rng().OneIn(3));
  }
  *out = b.Build(seed, seed);
  const BucketView v = out->SourceView();
  return Patchable(v, std::vector<const uint8_t*>(v.regions.size(),
                                                  out->src.data()));
}

struct Case {
  TestBucket bucket;             // src: the new version
  std::vector<uint8_t> previous;  // the source buffer as of the old one
  std::vector<uint64_t> bits;    // chunk i of the buffer differs
};

// Changes a fraction of the source's chunks; bits by plain comparison.
Case Make(TestBucket bucket, double density, uint64_t seed) {
  Case c;
  c.previous = bucket.src;
  TestRng rng(seed * 7919 + 1);
  const size_t chunks = bucket.src.size() / 2;
  for (size_t i = 0; i < chunks; ++i) {
    if (static_cast<double>(rng.Uniform(0, 999999)) / 1e6 < density) {
      bucket.src[2 * i + rng.Uniform(0, 1)] ^= 1 + rng.Uniform(0, 254);
    }
  }
  c.bits.assign((chunks + 63) / 64, 0);
  for (size_t i = 0; i < chunks; ++i) {
    if (std::memcmp(&bucket.src[2 * i], &c.previous[2 * i], 2) != 0) {
      c.bits[i / 64] |= uint64_t{1} << (i % 64);
    }
  }
  c.bucket = std::move(bucket);
  return c;
}

// The destination as it holds the previous version.
void HoldPrevious(Case& c) {
  TestBucket old = c.bucket;
  old.src = c.previous;
  c.bucket.dst = ExpectedDestination(old);
}

TEST_CASE("patch: applied to the previous version, gives the new one "
          "exactly, at every density") {
  int patched = 0, dense = 0;
  for (double density : {0.0, 0.001, 0.05, 0.5, 1.0}) {
    for (uint64_t seed = 1; seed <= 300; ++seed) {
      TestBucket bucket;
      if (!EvenBucket(seed, &bucket)) continue;
      Case c = Make(std::move(bucket), density, seed);
      HoldPrevious(c);
      const BucketView src = c.bucket.SourceView();
      const std::vector<ChunkChanges> changes(
          src.regions.size(), ChunkChanges{c.bucket.src.data(), c.bits.data()});
      const PatchPlan plan = PlanPatch(src, changes, src.bytes);
      INFO("density " << density << " seed " << seed << ": patch "
                      << plan.bytes << " of " << src.bytes);
      if (plan.dense) {
        ++dense;
        CHECK(plan.bytes >= src.bytes);
        continue;
      }
      ++patched;
      std::vector<uint8_t> patch(plan.bytes);
      WritePatch(src, plan, patch.data());
      const BucketView dst = c.bucket.DestinationView();
      absl::StatusOr<ParsedPatch> parsed =
          ParsePatch(dst, patch.data(), plan.bytes, "test");
      REQUIRE(parsed.ok());
      ApplyPatch(dst, *parsed, patch.data());
      CHECK(c.bucket.dst == ExpectedDestination(c.bucket));
      if (density == 0.0) CHECK(plan.changed_chunks == 0);
    }
  }
  // Both ways were taken (1.0 is always dense, 0.0 always a patch).
  CHECK(patched > 100);
  CHECK(dense > 20);
}

TEST_CASE("patch: an empty box has an empty bitmap (patch_fuzzer's first "
          "find: a memcpy from a null pointer)") {
  TestBucketBuilder b(4);
  b.AddBox({0, 5}, 2, /*dense=*/true);
  b.AddBox({3}, 2, /*dense=*/true);
  TestBucket bucket = b.Build(1, 1);
  const BucketView src = bucket.SourceView();
  std::vector<uint64_t> bits(1, 0b010);  // chunk 1 of the buffer changed
  const PatchPlan plan = PlanPatch(
      src, {ChunkChanges{bucket.src.data(), bits.data()},
            ChunkChanges{bucket.src.data(), bits.data()}},
      int64_t{1} << 20);
  REQUIRE_FALSE(plan.dense);
  std::vector<uint8_t> patch(plan.bytes);
  WritePatch(src, plan, patch.data());
  const BucketView dst = bucket.DestinationView();
  absl::StatusOr<ParsedPatch> parsed =
      ParsePatch(dst, patch.data(), plan.bytes, "empty");
  REQUIRE(parsed.ok());
  ApplyPatch(dst, *parsed, patch.data());
  CHECK(parsed->boxes[0].count == 0);
}

TEST_CASE("patch: an odd unit or an odd start is not patchable") {
  TestBucketBuilder b(5);
  b.AddBox({8}, 1, /*dense=*/true);
  TestBucket bucket = b.Build(1, 1);
  BucketView v = bucket.SourceView();
  CHECK_FALSE(Patchable(v, {bucket.src.data()}));
  TestBucketBuilder b2(6);
  b2.AddBox({8}, 2, /*dense=*/true);
  bucket = b2.Build(1, 1);
  v = bucket.SourceView();
  CHECK(Patchable(v, {bucket.src.data()}));
  CHECK_FALSE(Patchable(v, {bucket.src.data() + 1}));
  CHECK_FALSE(Patchable(v, {nullptr}));
  CHECK_FALSE(Patchable(v, {}));
}

TEST_CASE("patch: malformed patches are DATA_LOSS naming why, and random "
          "corruption never crashes") {
  TestBucketBuilder b(9);
  b.AddBox({64}, 2, /*dense=*/true);
  b.AddBox({4, 30}, 4, /*dense=*/true);
  Case c = Make(b.Build(3, 3), 0.05, 3);
  HoldPrevious(c);
  const BucketView src = c.bucket.SourceView();
  const std::vector<ChunkChanges> changes(
      src.regions.size(), ChunkChanges{c.bucket.src.data(), c.bits.data()});
  const PatchPlan plan = PlanPatch(src, changes, src.bytes);
  REQUIRE_FALSE(plan.dense);
  std::vector<uint8_t> patch(plan.bytes);
  WritePatch(src, plan, patch.data());
  const BucketView dst = c.bucket.DestinationView();
  auto parse = [&](const std::vector<uint8_t>& p) {
    return ParsePatch(dst, p.data(), static_cast<int64_t>(p.size()), "b7");
  };
  REQUIRE(parse(patch).ok());
  std::vector<uint8_t> bad = patch;
  bad.resize(bad.size() - 1);
  CHECK(absl::IsDataLoss(parse(bad).status()));
  bad = patch;
  bad.push_back(0);
  CHECK(absl::StrContains(parse(bad).status().message(),
                          "b7: patch is longer than its boxes"));
  bad = patch;
  bad[0] = 9;
  CHECK(absl::StrContains(parse(bad).status().message(), "has form 9"));
  bad = patch;
  const uint64_t huge = 1 << 20;
  std::memcpy(&bad[1], &huge, 8);
  CHECK(absl::StrContains(parse(bad).status().message(),
                          "changes 1048576 chunks of box 0's 64"));
  TestRng rng(77);
  for (int trial = 0; trial < 2000; ++trial) {
    bad = patch;
    for (int k = 0; k < 3; ++k) {
      bad[rng.Uniform(0, bad.size() - 1)] ^= 1 << rng.Uniform(0, 7);
    }
    if (rng.OneIn(4)) bad.resize(rng.Uniform(0, bad.size()));
    absl::StatusOr<ParsedPatch> parsed = parse(bad);
    if (parsed.ok()) ApplyPatch(dst, *parsed, bad.data());  // in bounds
    else CHECK(absl::IsDataLoss(parsed.status()));
  }
}

}  // namespace
}  // namespace ferry
