#include <catch2/catch.hpp>

#include <algorithm>
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

TEST_CASE("Streaming stores copy the same bytes as memcpy at any alignment, "
          "run length and stride") {
  // The oracle is the source itself, byte by byte: every run must land
  // whole, with the bytes around it untouched, whichever part of it
  // (unaligned head, 64-byte lines, tail) the streaming path took.
  std::vector<uint8_t> src(3 << 20);
  for (size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<uint8_t>(i * 131 + (i >> 9));
  }
  for (int64_t run : {int64_t{1}, int64_t{63}, kStreamingMinRun - 1,
                      kStreamingMinRun, kStreamingMinRun + 17,
                      int64_t{100003}}) {
    for (int64_t dst_shift : {0, 1, 8, 15}) {
      for (int64_t src_shift : {0, 3}) {
        // Three runs, a gap of 5 bytes between them on the destination and
        // of 11 on the source; then one contiguous run of all of it.
        const int64_t rows = 3;
        const int64_t dst_stride = run + 5, src_stride = run + 11;
        std::vector<uint8_t> dst(rows * dst_stride + 64, 0xAB);
        CopyStrided(src.data() + src_shift, {src_stride, 1},
                    dst.data() + dst_shift, {dst_stride, 1}, {rows, run}, 1,
                    StoreHint::kStreaming);
        bool same = true;
        for (int64_t i = 0; i < static_cast<int64_t>(dst.size()); ++i) {
          const int64_t at = i - dst_shift;
          const int64_t row = at >= 0 ? at / dst_stride : -1;
          const int64_t col = at >= 0 ? at % dst_stride : -1;
          const uint8_t want =
              (row >= 0 && row < rows && col < run)
                  ? src[src_shift + row * src_stride + col]
                  : uint8_t{0xAB};
          if (dst[i] != want) same = false;
        }
        INFO("run " << run << " dst+" << dst_shift << " src+" << src_shift);
        CHECK(same);
        std::vector<uint8_t> whole(rows * run + dst_shift, 0);
        CopyStrided(src.data() + src_shift, {1}, whole.data() + dst_shift,
                    {1}, {rows * run}, 1, StoreHint::kStreaming);
        CHECK(std::equal(whole.begin() + dst_shift, whole.end(),
                         src.begin() + src_shift));
      }
    }
  }
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
