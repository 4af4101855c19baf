// FP8 block quantization (core/fp8_blocks.h) against an oracle written in
// this test from the rule alone: each float8 byte's value decoded from the
// format's definition, a float rounded by searching every finite byte for
// the nearest value (ties to the even byte), and the block rule (amax
// clamped at 1e-4, x * (448 / amax), scale_inv = amax / 448) applied with
// plain loops. Nothing here calls the product's rounding to check it.
#include "core/fp8_blocks.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "tests/core/fp8_oracle.h"

namespace ferry {
namespace {

using namespace fp8_oracle;  // NOLINT: the oracle is this test's subject

TEST_CASE("every bf16 value rounds to the nearest e4m3 and e5m2 byte, "
          "ties to even, saturating",
          "[core][fp8]") {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float x = Bf16(static_cast<uint16_t>(h));
    INFO("bf16 0x" << std::hex << h << " = " << x);
    REQUIRE(FloatToE4M3(x) == OracleEncode(x, kE4M3Spec));
    if (!std::isinf(x)) REQUIRE(FloatToE5M2(x) == OracleEncode(x, kE5M2Spec));
  }
}

TEST_CASE("midpoints between float8 values go to the even byte, and "
          "float32 values round like the oracle",
          "[core][fp8]") {
  for (const Fp8Spec* s : {&kE4M3Spec, &kE5M2Spec}) {
    for (int c = 0; c + 1 < 0x80; ++c) {
      const double lo = Decode(static_cast<uint8_t>(c), *s);
      const double hi = Decode(static_cast<uint8_t>(c + 1), *s);
      if (!std::isfinite(lo) || !std::isfinite(hi)) continue;
      const float mid = static_cast<float>((lo + hi) / 2);  // exact
      const uint8_t got = s == &kE4M3Spec ? FloatToE4M3(mid) : FloatToE5M2(mid);
      INFO("between bytes " << c << " and " << c + 1);
      CHECK(got == ((c & 1) == 0 ? c : c + 1));
    }
  }
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-20, 18);
  std::uniform_real_distribution<float> mantissa(1, 2);
  for (int i = 0; i < 200000; ++i) {
    float x = std::ldexp(mantissa(rng), static_cast<int>(exponent(rng)));
    if (i & 1) x = -x;
    INFO(x);
    REQUIRE(FloatToE4M3(x) == OracleEncode(x, kE4M3Spec));
    REQUIRE(FloatToE5M2(x) == OracleEncode(x, kE5M2Spec));
  }
  CHECK(FloatToE4M3(1e9f) == 0x7e);
  CHECK(FloatToE4M3(-1e9f) == 0xfe);
  CHECK(FloatToE4M3(-0.0f) == 0x80);
  CHECK(E4M3ToFloat(0x7e) == 448.0f);
  CHECK(E5M2ToFloat(0x7b) == 57344.0f);
}

TEST_CASE("blocks of a bf16 tensor: every byte and every scale as the rule "
          "gives them, short last blocks, zero blocks, outliers",
          "[core][fp8]") {
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0, 0.02f);
  for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    // 300 x 200 in 128 x 128 blocks: a 3 x 2 grid, short last row and
    // column of blocks; also 64-row blocks.
    for (int64_t block_rows : {int64_t{128}, int64_t{64}}) {
      Fp8BlockShape shape{300, 200, block_rows, 128};
      std::vector<uint16_t> x(shape.rows * shape.cols);
      for (uint16_t& v : x) v = ToBf16Truncated(normal(rng));
      // Block (0, 0) all zeros, with negative zeros; block (1, 0) holds an
      // outlier, so its other elements land in e4m3's subnormals; a tiny
      // block below the 1e-4 clamp.
      for (int64_t r = 0; r < std::min<int64_t>(block_rows, 300); ++r) {
        for (int64_t c = 0; c < 128; ++c) {
          x[r * 200 + c] = (r + c) % 2 ? 0x8000 : 0x0000;
        }
      }
      x[(block_rows + 3) * 200 + 5] = ToBf16Truncated(3000.0f);
      for (int64_t r = 2 * block_rows; r < std::min<int64_t>(3 * block_rows, 300); ++r) {
        for (int64_t c = 128; c < 200; ++c) {
          x[r * 200 + c] = ToBf16Truncated(1e-6f * ((r + c) % 7 - 3));
        }
      }
      std::vector<uint8_t> got(x.size());
      std::vector<float> got_scales(shape.block_grid_rows() *
                                    shape.block_grid_cols());
      REQUIRE(QuantizeBlocks(x.data(), DType::kBF16, shape, fp8, got.data(),
                             got_scales.data())
                  .ok());
      INFO(DTypeName(fp8) << ", blocks of " << block_rows << " rows");
      CHECK(DifferenceFromRule(x, shape, fp8, got, got_scales) == "");
      CHECK(got[1] == 0x80);  // a negative zero stays one
      // Dequantized, each element is within half a step of its block's
      // grid: |x - q * scale_inv| <= amax / 448 * 2^-4 (e4m3, normal
      // range) or the block's subnormal step.
      if (fp8 == DType::kF8E4M3) {
        for (int64_t r = 0; r < shape.rows; ++r) {
          for (int64_t c = 0; c < shape.cols; ++c) {
            const float s_inv =
                got_scales[(r / block_rows) * shape.block_grid_cols() + c / 128];
            const float q = E4M3ToFloat(got[r * shape.cols + c]) * s_inv;
            const float v = Bf16(x[r * shape.cols + c]);
            const float step =
                std::max(std::fabs(v) / 16, s_inv * std::ldexp(1.0f, -10));
            REQUIRE(std::fabs(q - v) <= step * 1.0001f + 1e-30f);
          }
        }
      }
    }
  }
}

TEST_CASE("a tensor split between holders at any element: each reads its "
          "blocks' max |x| with the rest as zeros, the largest bits win, "
          "and each one's bytes are the whole tensor's, NaN blocks too",
          "[core][fp8]") {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0, 0.02f);
  const Fp8BlockShape shape{300, 200, 128, 128};
  std::vector<uint16_t> x(shape.rows * shape.cols);
  for (uint16_t& v : x) v = ToBf16Truncated(normal(rng));
  x[5 * 200 + 7] = ToBf16Truncated(-900.0f);  // block (0, 0)'s amax, holder 0
  x[140 * 200 + 150] = 0x7fc1;                 // a NaN in block (1, 1)
  const size_t grid = shape.block_grid_rows() * shape.block_grid_cols();
  for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    std::vector<uint8_t> want(x.size());
    std::vector<float> want_scales(grid);
    REQUIRE(QuantizeBlocks(x.data(), DType::kBF16, shape, fp8, want.data(),
                           want_scales.data())
                .ok());
    // (The whole tensor's bytes are the rule's: tested above. The oracle
    // skips NaN where torch's amax, and this routine, propagate it.)
    for (size_t cut : {size_t{1}, size_t{5 * 200 + 7}, size_t{25601},
                       size_t{140 * 200 + 151}, x.size() - 1}) {
      INFO(DTypeName(fp8) << ", cut at element " << cut);
      // Holder k's copy: its elements, zeros elsewhere.
      std::vector<std::vector<uint16_t>> held(2, std::vector<uint16_t>(x.size(), 0));
      std::copy(x.begin(), x.begin() + cut, held[0].begin());
      std::copy(x.begin() + cut, x.end(), held[1].begin() + cut);
      std::vector<uint32_t> combined(grid, 0);
      for (const auto& h : held) {
        std::vector<uint32_t> mine(grid);
        REQUIRE(BlockAbsMaxBits(h.data(), DType::kBF16, shape, mine.data()).ok());
        for (size_t k = 0; k < grid; ++k) combined[k] = std::max(combined[k], mine[k]);
      }
      std::vector<uint8_t> got(x.size());
      for (int k = 0; k < 2; ++k) {
        std::vector<uint8_t> out(x.size());
        std::vector<float> scales(grid);
        REQUIRE(QuantizeBlocksWithAmax(held[k].data(), DType::kBF16, shape, fp8,
                                       combined.data(), out.data(), scales.data())
                    .ok());
        std::copy(out.begin() + (k == 0 ? 0 : cut),
                  k == 0 ? out.begin() + cut : out.end(),
                  got.begin() + (k == 0 ? 0 : cut));
        CHECK(std::memcmp(scales.data(), want_scales.data(), grid * 4) == 0);
      }
      for (size_t k = 0; k < grid; ++k) {
        const float s_inv = Fp8ScaleInv(combined[k], fp8);
        CHECK(std::memcmp(&s_inv, &want_scales[k], 4) == 0);
      }
      CHECK(got == want);
    }
  }
}

TEST_CASE("rows of a tensor held apart (cut inside a block row): each "
          "holder's rows read and quantized where they lie give the whole "
          "tensor's bytes", "[core][fp8]") {
  std::mt19937 rng(9);
  std::normal_distribution<float> normal(0, 0.02f);
  const Fp8BlockShape shape{300, 200, 128, 128};
  std::vector<uint16_t> x(shape.rows * shape.cols);
  for (uint16_t& v : x) v = ToBf16Truncated(normal(rng));
  x[150 * 200 + 3] = ToBf16Truncated(77.0f);  // block (1, 0), second holder
  const size_t grid = shape.block_grid_rows() * shape.block_grid_cols();
  std::vector<uint8_t> want(x.size());
  std::vector<float> want_scales(grid);
  REQUIRE(QuantizeBlocks(x.data(), DType::kBF16, shape, DType::kF8E4M3,
                         want.data(), want_scales.data())
              .ok());
  for (int64_t cut : {int64_t{1}, int64_t{128}, int64_t{140}, int64_t{299}}) {
    INFO("rows cut at " << cut);
    const int64_t first[2] = {0, cut}, count[2] = {cut, shape.rows - cut};
    std::vector<uint32_t> bits(grid, 0);
    for (int k = 0; k < 2; ++k) {
      REQUIRE(RaiseRowsAbsMaxBits(x.data() + first[k] * shape.cols,
                                  DType::kBF16, shape, first[k], count[k],
                                  bits.data())
                  .ok());
    }
    std::vector<uint8_t> got(x.size(), 0xEE);
    std::vector<float> scales(grid, -1.0f);
    for (int k = 0; k < 2; ++k) {
      REQUIRE(QuantizeRows(x.data() + first[k] * shape.cols, DType::kBF16,
                           shape, first[k], count[k], DType::kF8E4M3,
                           bits.data(), got.data() + first[k] * shape.cols,
                           scales.data())
                  .ok());
    }
    CHECK(got == want);
    CHECK(std::memcmp(scales.data(), want_scales.data(), grid * 4) == 0);
  }
  // A range outside the tensor, or a part of it without amaxes given.
  std::vector<uint8_t> out(x.size());
  CHECK(QuantizeRows(x.data(), DType::kBF16, shape, 290, 20, DType::kF8E4M3,
                     nullptr, out.data(), nullptr)
            .code() == absl::StatusCode::kInvalidArgument);
  CHECK(QuantizeRows(x.data(), DType::kBF16, shape, 0, 10, DType::kF8E4M3,
                     nullptr, out.data(), nullptr)
            .code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the scale is 448 / amax, then x times it: another order of the "
          "same arithmetic gives other bytes, and is caught",
          "[core][fp8]") {
  // Find a block [amax, x] (bf16) where x * (448 / amax) and
  // x * (1 / (amax / 448)) round to different e4m3 bytes.
  bool found = false;
  for (uint32_t ha = 0x3c00; ha < 0x3f80 && !found; ++ha) {  // [2^-7, 1)
    const float amax = Bf16(static_cast<uint16_t>(ha));
    const float rule = 448.0f / amax;
    const float other = 1.0f / (amax / 448.0f);
    if (rule == other) continue;
    for (uint32_t hx = 0x3c00; hx < ha && !found; ++hx) {
      const float x = Bf16(static_cast<uint16_t>(hx));
      const uint8_t want = OracleEncode(x * rule, kE4M3Spec);
      if (want == OracleEncode(x * other, kE4M3Spec)) continue;
      found = true;
      const uint16_t block[2] = {static_cast<uint16_t>(ha),
                                 static_cast<uint16_t>(hx)};
      uint8_t out[2];
      float scale_inv;
      REQUIRE(QuantizeBlocks(block, DType::kBF16, Fp8BlockShape{1, 2},
                             DType::kF8E4M3, out, &scale_inv)
                  .ok());
      INFO("amax " << amax << ", x " << x);
      CHECK(out[1] == want);
      CHECK(scale_inv == amax / 448.0f);
    }
  }
  REQUIRE(found);
}

TEST_CASE("through the block routine (the vector path where the CPU has "
          "one, and its scalar tail), every bf16 value up to the format's "
          "largest rounds to the oracle's byte") {
  // Blocks of 1 x 128 (and a short last block of 72 columns) whose first
  // element is the format's largest value: amax is that, the scale
  // exactly 1, so each other element is simply rounded.
  for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    const bool e4m3 = fp8 == DType::kF8E4M3;
    const Fp8Spec& spec = e4m3 ? kE4M3Spec : kE5M2Spec;
    const uint16_t largest = e4m3 ? 0x43e0 : 0x4760;  // 448, 57344
    REQUIRE(Bf16(largest) == Fp8Max(fp8));
    std::vector<uint16_t> values;
    for (uint32_t h = 0; h <= largest; ++h) {
      values.push_back(static_cast<uint16_t>(h));
      values.push_back(static_cast<uint16_t>(h | 0x8000));
    }
    const int64_t cols = 200;  // blocks of 128 and 72 columns
    std::vector<uint16_t> x;
    size_t next = 0;
    while (next < values.size()) {
      for (int64_t c = 0; c < cols; ++c) {
        const bool first = c == 0 || c == 128;
        x.push_back(first ? largest
                          : values[next < values.size() ? next++ : 0]);
      }
    }
    const Fp8BlockShape shape{static_cast<int64_t>(x.size()) / cols, cols, 1,
                              128};
    std::vector<uint8_t> out(x.size());
    std::vector<float> scales(shape.block_grid_rows() * shape.block_grid_cols());
    REQUIRE(QuantizeBlocks(x.data(), DType::kBF16, shape, fp8, out.data(),
                           scales.data())
                .ok());
    int64_t wrong = 0;
    std::string first_wrong;
    for (size_t i = 0; i < x.size(); ++i) {
      const uint8_t want = OracleEncode(Bf16(x[i]), spec);
      if (out[i] != want && wrong++ == 0) {
        first_wrong = absl::StrCat("bf16 0x", absl::Hex(x[i]), " -> 0x",
                                   absl::Hex(out[i]), ", want 0x",
                                   absl::Hex(want));
      }
    }
    INFO(DTypeName(fp8) << ": " << first_wrong);
    CHECK(wrong == 0);
    for (float s : scales) CHECK(s == 1.0f);
  }
}

TEST_CASE("f32 and f16 sources quantize as their bf16 equal does",
          "[core][fp8]") {
  // Values exact in all three dtypes give the same bytes and scales.
  Fp8BlockShape shape{4, 6, 2, 4};
  std::vector<float> f32 = {0.5f, -1.25f, 3.0f, 0.0f, -0.0f, 7.5f,
                            0.125f, 2.0f, -4.0f, 1.5f, 0.75f, -6.0f,
                            1.0f, 1.0f, 1.0f, -2.5f, 0.25f, 0.375f,
                            -0.5f, 9.0f, 10.0f, -11.0f, 12.0f, 0.0625f};
  std::vector<uint16_t> bf16, f16;
  for (float v : f32) {
    bf16.push_back(ToBf16Truncated(v));
    // f16 of these exact values: sign, exponent rebiased, mantissa top bits.
    uint32_t u;
    std::memcpy(&u, &v, 4);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000);
    if ((u & 0x7fffffff) == 0) {
      f16.push_back(sign);
      continue;
    }
    const int e = static_cast<int>((u >> 23) & 0xff) - 127 + 15;
    f16.push_back(static_cast<uint16_t>(sign | (e << 10) | ((u >> 13) & 0x3ff)));
  }
  std::vector<uint8_t> a(24), b(24), c(24);
  std::vector<float> sa(4), sb(4), sc(4);
  REQUIRE(QuantizeBlocks(f32.data(), DType::kF32, shape, DType::kF8E4M3,
                         a.data(), sa.data()).ok());
  REQUIRE(QuantizeBlocks(bf16.data(), DType::kBF16, shape, DType::kF8E4M3,
                         b.data(), sb.data()).ok());
  REQUIRE(QuantizeBlocks(f16.data(), DType::kF16, shape, DType::kF8E4M3,
                         c.data(), sc.data()).ok());
  CHECK(a == b);
  CHECK(a == c);
  CHECK(sa == sb);
  CHECK(sa == sc);
  CHECK(sa[0] == 4.0f / 448.0f);  // block (0, 0): rows 0-1, cols 0-3
}

TEST_CASE("what cannot be quantized is INVALID_ARGUMENT, naming it",
          "[core][fp8]") {
  float x = 1;
  uint8_t out;
  float scale;
  Fp8BlockShape shape{1, 1, 128, 128};
  absl::Status s = QuantizeBlocks(&x, DType::kI32, shape, DType::kF8E4M3,
                                  &out, &scale);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(s.message()).find("i32") != std::string::npos);
  s = QuantizeBlocks(&x, DType::kF32, shape, DType::kBF16, &out, &scale);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  shape.block_rows = 0;
  s = QuantizeBlocks(&x, DType::kF32, shape, DType::kF8E4M3, &out, &scale);
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry
