// core/byte_overlap.h: strided layouts that share a byte are found, exactly
// for interleaved ones, and the common cases stay near-linear.
#include "core/byte_overlap.h"

#include <chrono>
#include <random>
#include <set>
#include <vector>

#include "catch2/catch.hpp"

namespace ferry {
namespace {

StridedLayout L(int64_t offset, Dims extent, Dims stride, int64_t unit = 4,
                uint64_t key = 0) {
  StridedLayout l;
  l.key = key;
  l.offset = offset;
  l.extent = std::move(extent);
  l.stride = std::move(stride);
  l.unit_bytes = unit;
  return l;
}

// Column c of a [rows, cols] F32 tensor at byte 0.
StridedLayout Column(int64_t c, int64_t rows, int64_t cols) {
  return L(c * 4, {rows, 1}, {cols, 1});
}

TEST_CASE("A layout alone: strides that put two elements on one byte",
          "[overlap]") {
  CHECK(SelfOverlapProblem(L(0, {4, 8}, {8, 1})) == "");
  CHECK(SelfOverlapProblem(L(0, {8, 4}, {1, 8})) == "");  // transposed
  CHECK(SelfOverlapProblem(L(0, {4, 8}, {16, 1})) == "");  // row pitch
  // A zero stride along a dimension of extent > 1: refused.
  CHECK(SelfOverlapProblem(L(0, {4, 8}, {0, 1})) ==
        "stride 0 along dim 0 (extent 4) puts several elements on one byte");
  // ... but harmless along a dimension of extent 1, or in an empty box.
  CHECK(SelfOverlapProblem(L(0, {1, 8}, {0, 1})) == "");
  CHECK(SelfOverlapProblem(L(0, {0, 8}, {0, 0})) == "");
  // Rows closer than their length overlap.
  CHECK(SelfOverlapProblem(L(0, {4, 8}, {4, 1})) ==
        "stride 4 along dim 0 is below the span 8 of the dimensions inside "
        "it: two elements may share a byte");
}

TEST_CASE("Contiguous layouts: touching is fine, sharing a byte is not",
          "[overlap]") {
  std::vector<StridedLayout> ls = {L(0, {4, 8}, {8, 1}),
                                   L(128, {4, 8}, {8, 1})};
  CHECK_FALSE(FindOverlap(ls, 1 << 20).found());
  ls.push_back(L(124, {1}, {1}));  // the last element of the first
  const OverlapResult r = FindOverlap(ls, 1 << 20);
  REQUIRE(r.found());
  CHECK(r.first == 0);
  CHECK(r.second == 2);
  CHECK(r.at_byte == 124);
  CHECK_FALSE(r.budget_exhausted);
  // Other memory (another key) never overlaps.
  ls[2].key = 1;
  CHECK_FALSE(FindOverlap(ls, 1 << 20).found());
}

TEST_CASE("Interleaved columns are disjoint; a repeated column is not",
          "[overlap]") {
  std::vector<StridedLayout> ls;
  for (int64_t c = 0; c < 64; ++c) ls.push_back(Column(c, 3, 64));
  CHECK_FALSE(FindOverlap(ls, 1 << 20).found());
  ls.push_back(Column(17, 3, 64));
  const OverlapResult r = FindOverlap(ls, 1 << 20);
  REQUIRE(r.found());
  CHECK(r.first == 17);
  CHECK(r.second == 64);
  CHECK(r.at_byte == 17 * 4);
  // A column block of width 2 over columns 5 and 6 shares column 5.
  ls.pop_back();
  ls.push_back(L(5 * 4, {3, 2}, {64, 1}));
  CHECK(FindOverlap(ls, 1 << 20).found());
}

TEST_CASE("Interleaving too fine to prove within the budget is reported",
          "[overlap]") {
  std::vector<StridedLayout> ls;
  for (int64_t c = 0; c < 64; ++c) ls.push_back(Column(c, 3, 64));
  const OverlapResult r = FindOverlap(ls, 10);
  REQUIRE(r.found());
  CHECK(r.budget_exhausted);
}

TEST_CASE("100,000 one-column pieces are checked in well under a second",
          "[overlap]") {
  std::vector<StridedLayout> ls;
  const int64_t n = 100000;
  for (int64_t c = 0; c < n; ++c) ls.push_back(Column(c, 2, n));
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_FALSE(FindOverlap(ls, int64_t{1} << 22).found());
  const double s = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - t0)
                       .count();
  INFO(s << " s");
  CHECK(s < 2.0);  // about 0.05 s; generous for a loaded machine
}

// Every byte `l` writes, by brute force.
std::set<int64_t> BytesOf(const StridedLayout& l) {
  std::set<int64_t> bytes;
  int64_t count = 1;
  for (int64_t e : l.extent) count *= e;
  for (int64_t n = 0; n < count; ++n) {
    int64_t rest = n, units = 0;
    for (size_t d = l.extent.size(); d-- > 0;) {
      units += (rest % l.extent[d]) * l.stride[d];
      rest /= l.extent[d];
    }
    for (int64_t b = 0; b < l.unit_bytes; ++b) {
      bytes.insert(l.offset + units * l.unit_bytes + b);
    }
  }
  return bytes;
}

TEST_CASE("Random layouts in random order: found exactly when two share a "
          "byte, checked byte by byte",
          "[overlap]") {
  std::mt19937_64 rng(7);
  auto pick = [&rng](int64_t lo, int64_t hi) {
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int overlapping = 0;
  for (int round = 0; round < 400; ++round) {
    // Dense keys (parameter or buffer indices) and sparse ones take
    // different sorting paths; both must give the same answer.
    const bool sparse = round % 2 == 1;
    std::vector<StridedLayout> ls;
    const int n = static_cast<int>(pick(2, 30));
    while (static_cast<int>(ls.size()) < n) {
      const size_t rank = static_cast<size_t>(pick(1, 2));
      Dims extent, stride;
      for (size_t d = 0; d < rank; ++d) {
        extent.push_back(pick(0, 4));
        stride.push_back(pick(1, 12));
      }
      const uint64_t key = static_cast<uint64_t>(pick(0, 2)) *
                           (sparse ? (uint64_t{1} << 40) : 1);
      StridedLayout l = L(pick(0, 300), extent, stride, pick(1, 4), key);
      if (!SelfOverlapProblem(l).empty()) continue;
      ls.push_back(std::move(l));
    }
    std::vector<std::set<int64_t>> bytes;
    for (const StridedLayout& l : ls) bytes.push_back(BytesOf(l));
    bool expected = false;
    for (size_t a = 0; a < ls.size() && !expected; ++a) {
      for (size_t b = a + 1; b < ls.size() && !expected; ++b) {
        if (ls[a].key != ls[b].key) continue;
        for (int64_t x : bytes[a]) {
          if (bytes[b].count(x) > 0) {
            expected = true;
            break;
          }
        }
      }
    }
    const OverlapResult r = FindOverlap(ls, int64_t{1} << 20);
    INFO("round " << round);
    REQUIRE_FALSE(r.budget_exhausted);
    REQUIRE(r.found() == expected);
    if (!r.found()) continue;
    ++overlapping;
    // The pair it names shares the byte it names.
    CHECK(ls[r.first].key == ls[r.second].key);
    CHECK(bytes[r.first].count(r.at_byte) == 1);
    CHECK(bytes[r.second].count(r.at_byte) == 1);
  }
  // Both outcomes were exercised.
  CHECK(overlapping > 40);
  CHECK(overlapping < 360);
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

TEST_CASE("An odd number of interleaved layouts: merged runs find the pair",
          "[overlap]") {
  // Five columns of a [1000, 5] F32 tensor, each a layout of 1000 runs
  // (CheckCluster merges them three levels deep).
  std::vector<StridedLayout> ls;
  for (int64_t c = 0; c < 5; ++c) ls.push_back(Column(c, 1000, 5));
  CHECK_FALSE(FindOverlap(ls, 1 << 20).found());
  // The last column moved onto the third: the pair (2, 4), at its first
  // byte.
  ls[4] = Column(2, 1000, 5);
  const OverlapResult r = FindOverlap(ls, 1 << 20);
  REQUIRE(r.found());
  CHECK(r.first == 2);
  CHECK(r.second == 4);
  CHECK(r.at_byte == 8);
  // Listed in another order, the same pair.
  std::swap(ls[0], ls[4]);
  const OverlapResult s = FindOverlap(ls, 1 << 20);
  REQUIRE(s.found());
  CHECK(s.first == 0);
  CHECK(s.second == 2);
  CHECK(s.at_byte == 8);
}

}  // namespace
}  // namespace ferry
