#include <catch2/catch.hpp>

#include <numeric>
#include <vector>

#include "core/region_copy.h"

namespace ferry {
namespace {

TEST_CASE("CopyStrided moves a column block of a row-major matrix") {
  // 4x6 source of bytes 0..23; copy rows 1-2, cols 2-4 into a 2x3 dest.
  std::vector<uint8_t> src(24);
  std::iota(src.begin(), src.end(), 0);
  std::vector<uint8_t> dst(6, 0xFF);
  CopyStrided(src.data() + 1 * 6 + 2, {6, 1}, dst.data(), {3, 1}, {2, 3}, 1);
  CHECK(dst == std::vector<uint8_t>{8, 9, 10, 14, 15, 16});
}

TEST_CASE("CopyStrided handles transposed strides and multi-byte units") {
  std::vector<uint16_t> src = {1, 2, 3, 4, 5, 6};  // 2x3
  std::vector<uint16_t> dst(6, 0);                 // 3x2 holding the transpose
  CopyStrided(reinterpret_cast<uint8_t*>(src.data()), {3, 1},
              reinterpret_cast<uint8_t*>(dst.data()), {1, 2}, {2, 3}, 2);
  CHECK(dst == std::vector<uint16_t>{1, 4, 2, 5, 3, 6});
}

TEST_CASE("Pack and unpack round-trip a 4-D box") {
  const Dims shape = {3, 4, 5, 6};
  std::vector<uint8_t> buf(Volume(shape));
  std::iota(buf.begin(), buf.end(), 0);
  Piece whole = Piece::Contiguous(0, FullBox(shape), 0, 0, DType::kU8);
  Box box{{1, 1, 2, 0}, {2, 2, 3, 6}};
  std::vector<uint8_t> packed(Volume(box));
  CHECK(PackBox(buf.data(), whole, box, DType::kU8, packed.data()) == 72);
  CHECK(packed[0] == 1 * 120 + 1 * 30 + 2 * 6);
  std::vector<uint8_t> out(Volume(shape), 0);
  UnpackBox(packed.data(), out.data(), whole, box, DType::kU8);
  for (int64_t i = 0; i < 3; ++i)
    for (int64_t j = 0; j < 4; ++j)
      for (int64_t k = 0; k < 5; ++k)
        for (int64_t l = 0; l < 6; ++l) {
          const int64_t at = ((i * 4 + j) * 5 + k) * 6 + l;
          const bool inside = i >= 1 && i < 3 && j >= 1 && j < 3 && k >= 2;
          CHECK(out[at] == (inside ? buf[at] : 0));
        }
}

}  // namespace
}  // namespace ferry
