// The demo's deterministic weights: fill and check agree, differ by version
// and parameter, and CheckPiece finds a flipped byte in a strided piece.
#include <catch2/catch.hpp>

#include <vector>

#include "examples/demo/weight_pattern.h"

namespace ferry {
namespace {

TEST_CASE("the pattern is a function of version, name and byte") {
  std::vector<uint8_t> a(100), b(100), c(37);
  FillPattern(PatternSeed(1, "w"), 3, a.data(), a.size());
  FillPattern(PatternSeed(1, "w"), 3, b.data(), b.size());
  CHECK(a == b);
  // Any sub-range matches, whatever its alignment.
  FillPattern(PatternSeed(1, "w"), 3 + 50, c.data(), c.size());
  CHECK(std::equal(c.begin(), c.end(), a.begin() + 50));
  CHECK(FindPatternMismatch(PatternSeed(1, "w"), 3, a.data(), a.size()) == -1);
  CHECK(FindPatternMismatch(PatternSeed(2, "w"), 3, a.data(), a.size()) >= 0);
  CHECK(FindPatternMismatch(PatternSeed(1, "v"), 3, a.data(), a.size()) >= 0);
  a[61] ^= 1;
  CHECK(FindPatternMismatch(PatternSeed(1, "w"), 3, a.data(), a.size()) == 61);
}

TEST_CASE("pieces: a strided column shard checks against the whole tensor") {
  const ParamSpec p{"model.layers.0.mlp.down_proj.weight", DType::kBF16,
                    Dims{6, 10}};
  // The whole tensor, contiguous, at version 4.
  std::vector<uint8_t> whole(6 * 10 * 2);
  const Piece full = Piece::Contiguous(0, FullBox(p.shape), 0, 0, p.dtype);
  FillPiece(4, p, full, whole.data());
  CHECK(CheckPiece(4, p, full, whole.data()).ok());

  // Columns [4, 10) seen in place, with the whole tensor's strides.
  Piece cols;
  cols.param = 0;
  cols.box = Box{{0, 4}, {6, 6}};
  cols.byte_offset = 4 * 2;
  cols.strides = Dims{10, 1};
  CHECK(CheckPiece(4, p, cols, whole.data()).ok());

  // The same columns written into their own contiguous buffer.
  std::vector<uint8_t> shard(6 * 6 * 2);
  const Piece own = Piece::Contiguous(0, cols.box, 0, 0, p.dtype);
  FillPiece(4, p, own, shard.data());
  for (int r = 0; r < 6; ++r) {
    CHECK(std::equal(shard.begin() + r * 12, shard.begin() + r * 12 + 12,
                     whole.begin() + r * 20 + 8));
  }
  shard[5 * 12 + 3] ^= 0xff;  // row 5, column 4 + 1, second byte
  const absl::Status s = CheckPiece(4, p, own, shard.data());
  REQUIRE(s.code() == absl::StatusCode::kDataLoss);
  CHECK_THAT(std::string(s.message()),
             Catch::StartsWith("model.layers.0.mlp.down_proj.weight box "
                               "[0:6, 4:10] at version 4: byte 111 of the "
                               "tensor is"));
  CHECK(CheckPiece(5, p, full, whole.data()).code() == absl::StatusCode::kDataLoss);
}

TEST_CASE("pieces: a non-unit innermost stride and a 3-D box") {
  const ParamSpec p{"e", DType::kF32, Dims{2, 3, 4}};
  std::vector<uint8_t> whole(2 * 3 * 4 * 4);
  FillPiece(1, p, Piece::Contiguous(0, FullBox(p.shape), 0, 0, p.dtype),
            whole.data());
  Piece transposed_view;  // box [1:2, 0:3, 1:3] read with strides 12, 4, 1
  transposed_view.param = 0;
  transposed_view.box = Box{{1, 0, 1}, {1, 3, 2}};
  transposed_view.byte_offset = (12 + 1) * 4;
  transposed_view.strides = Dims{12, 4, 1};
  CHECK(CheckPiece(1, p, transposed_view, whole.data()).ok());
  Piece every_other;  // columns 0 and 2 of row [0, 0, :]
  every_other.param = 0;
  every_other.box = Box{{0, 0, 0}, {1, 1, 2}};
  every_other.byte_offset = 0;
  every_other.strides = Dims{12, 4, 2};  // reads columns 0 and 2: wrong
  CHECK(CheckPiece(1, p, every_other, whole.data()).code() ==
        absl::StatusCode::kDataLoss);
}

}  // namespace
}  // namespace ferry
