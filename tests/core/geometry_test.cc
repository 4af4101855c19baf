#include <catch2/catch.hpp>

#include "core/dtype.h"
#include "core/geometry.h"
#include "core/piece.h"

namespace ferry {
namespace {

Box MakeBox(Dims offset, Dims extent) { return Box{offset, extent}; }

TEST_CASE("Intersect returns the overlap or nothing") {
  const Box a = MakeBox({0, 0}, {4, 8});
  const Box b = MakeBox({2, 6}, {4, 4});
  auto i = Intersect(a, b);
  REQUIRE(i.has_value());
  CHECK(*i == MakeBox({2, 6}, {2, 2}));
  CHECK_FALSE(Intersect(a, MakeBox({4, 0}, {1, 8})).has_value());
  CHECK(Contains(a, *i));
  CHECK_FALSE(Contains(b, a));
}

TEST_CASE("ValidateShape rejects negative and overflowing dims") {
  CHECK(ValidateShape({4, 5}, 2).ok());
  CHECK(ValidateShape({-1, 5}).code() == absl::StatusCode::kInvalidArgument);
  CHECK(ValidateShape({int64_t{1} << 40, int64_t{1} << 30}).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ValidateShape({int64_t{1} << 31, int64_t{1} << 31}, 4).code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("ValidateBoxInShape names the box") {
  auto s = ValidateBoxInShape(MakeBox({2, 0}, {3, 4}), {4, 4});
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("[2:5, 0:4]") != std::string::npos);
  CHECK(ValidateBoxInShape(MakeBox({0}, {4}), {4, 4}).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(ValidateBoxInShape(MakeBox({int64_t{1} << 62, 0}, {int64_t{1} << 62, 1}),
                           {4, 4})
            .code() == absl::StatusCode::kInvalidArgument);
}

// Every flat index in [begin, end) is covered exactly once by the boxes, and
// each box is contiguous in flat order.
void CheckFlatRange(const Dims& shape, int64_t begin, int64_t end) {
  const auto boxes = FlatRangeToBoxes(shape, begin, end);
  const Dims strides = RowMajorStrides(shape);
  std::vector<int> hits(Volume(shape), 0);
  int64_t expect_next = begin;
  for (const Box& box : boxes) {
    REQUIRE(ValidateBoxInShape(box, shape).ok());
    int64_t first = 0;
    for (size_t i = 0; i < shape.size(); ++i) first += box.offset[i] * strides[i];
    CHECK(first == expect_next);  // in flat order, contiguous
    expect_next = first + Volume(box);
    for (int64_t k = first; k < first + Volume(box); ++k) hits[k]++;
  }
  CHECK(expect_next == (begin < end ? end : begin));
  for (int64_t k = 0; k < Volume(shape); ++k) {
    CHECK(hits[k] == ((k >= begin && k < end) ? 1 : 0));
  }
  CHECK(boxes.size() <= 2 * shape.size() - 1 + (shape.empty() ? 1 : 0));
}

TEST_CASE("FlatRangeToBoxes covers FSDP flat ranges exactly") {
  CheckFlatRange({6, 5}, 0, 30);
  CheckFlatRange({6, 5}, 3, 27);
  CheckFlatRange({6, 5}, 7, 9);
  CheckFlatRange({6, 5}, 4, 6);
  CheckFlatRange({3, 4, 5}, 7, 53);
  CheckFlatRange({3, 4, 5}, 21, 22);
  CheckFlatRange({2, 3, 4, 5, 2}, 13, 211);
  for (int64_t b = 0; b <= 24; ++b) {
    for (int64_t e = b; e <= 24; ++e) CheckFlatRange({2, 3, 4}, b, e);
  }
}

TEST_CASE("DTypes know their block geometry") {
  CHECK(UnitBytes(DType::kBF16) == 2);
  CHECK(BlockElems(DType::kQ4_K) == 256);
  CHECK(UnitBytes(DType::kQ4_K) == 144);
  CHECK(UnitBytes(DType::kQ8_0) == 34);
  CHECK(UnitBytes(DType::kQ6_K) == 210);
  CHECK(*ParseDType("BF16") == DType::kBF16);
  CHECK(*ParseDType("F8_E4M3") == DType::kF8E4M3);
  CHECK(*ParseDType("Q4_K") == DType::kQ4_K);
  CHECK(ParseDType("fp13").status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Piece offsets follow local strides, in blocks for quantized types") {
  // A column shard [2:4, 0:512] of a q4_0 tensor held in a local [2, 512]
  // tensor: 16 blocks per row, 18 bytes per block.
  Piece p = Piece::InLocalTensor(0, MakeBox({2, 0}, {2, 512}), 0, 100, {2, 512},
                                 {0, 0}, DType::kQ4_0);
  CHECK(p.strides == Dims{16, 1});
  CHECK(ByteOffsetOf(p, MakeBox({3, 64}, {1, 32}), DType::kQ4_0) ==
        100 + (16 + 2) * 18);
  CHECK(*PieceEndByte(p, DType::kQ4_0) == 100 + 32 * 18);
}

}  // namespace
}  // namespace ferry
