// The FP8 block rule (core/fp8_blocks.h) written again from its
// definition alone, for tests: each float8 byte's value decoded from the
// format, a float rounded by searching every finite byte for the nearest
// value (ties to the even byte, saturating), and the block rule in plain
// loops. Shared by the CPU test (tests/core/fp8_blocks_test.cc) and the
// GPU kernel's (tests/gpu/gpu_fp8_test.cc): the product's routines are
// checked against this, never against each other.
#ifndef FERRY_TESTS_CORE_FP8_ORACLE_H_
#define FERRY_TESTS_CORE_FP8_ORACLE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "core/fp8_blocks.h"

namespace ferry {
namespace fp8_oracle {

struct Fp8Spec {
  int exp_bits, mantissa_bits, bias;
  bool fn;  // e4m3fn: no infinities, only 0x7f / 0xff are NaN
};
constexpr Fp8Spec kE4M3Spec{4, 3, 7, true};
constexpr Fp8Spec kE5M2Spec{5, 2, 15, false};

// The value of a byte, from the format's definition; NaN for NaN and, in
// e5m2, infinity for the two infinities.
inline double Decode(uint8_t b, const Fp8Spec& s) {
  const int sign = b >> 7;
  const int e = (b >> s.mantissa_bits) & ((1 << s.exp_bits) - 1);
  const int m = b & ((1 << s.mantissa_bits) - 1);
  const int top = (1 << s.exp_bits) - 1;
  if (s.fn && e == top && m == (1 << s.mantissa_bits) - 1) return NAN;
  if (!s.fn && e == top) return m == 0 ? (sign ? -INFINITY : INFINITY) : NAN;
  double v = e == 0 ? m * std::pow(2.0, 1 - s.bias - s.mantissa_bits)
                    : (1.0 + m / double(1 << s.mantissa_bits)) *
                          std::pow(2.0, e - s.bias);
  return sign ? -v : v;
}

// x rounded to the nearest finite byte (ties to the byte whose last
// mantissa bit is 0), saturating at the largest; NaN to 0x7f with x's
// sign.
// The values of the bytes 0x00-0x7f, decoded once per format: the search
// below reads them 256 times per element.
struct PositiveValues {
  double v[0x80];
  explicit PositiveValues(const Fp8Spec& s) {
    for (int c = 0; c < 0x80; ++c) v[c] = Decode(static_cast<uint8_t>(c), s);
  }
};
inline const PositiveValues& PositivesOf(const Fp8Spec& s) {
  static const PositiveValues e4m3(kE4M3Spec), e5m2(kE5M2Spec);
  if (s.exp_bits == kE4M3Spec.exp_bits && s.fn == kE4M3Spec.fn &&
      s.mantissa_bits == kE4M3Spec.mantissa_bits && s.bias == kE4M3Spec.bias) {
    return e4m3;
  }
  if (s.exp_bits == kE5M2Spec.exp_bits && s.fn == kE5M2Spec.fn &&
      s.mantissa_bits == kE5M2Spec.mantissa_bits && s.bias == kE5M2Spec.bias) {
    return e5m2;
  }
  thread_local PositiveValues other(s);
  other = PositiveValues(s);
  return other;
}

inline uint8_t OracleEncode(float x, const Fp8Spec& s) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const uint8_t sign = (bits >> 31) ? 0x80 : 0;
  if (std::isnan(x)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(x));
  const PositiveValues& values = PositivesOf(s);
  // Past the largest finite value: that value (saturation). Searching
  // would tie there once doubles cannot tell the distances apart.
  double largest = 0;
  int largest_code = 0;
  for (int c = 0; c < 0x80; ++c) {
    const double v = values.v[c];
    if (std::isfinite(v) && v > largest) {
      largest = v;
      largest_code = c;
    }
  }
  if (a >= largest) return sign | static_cast<uint8_t>(largest_code);
  int best = 0;
  double best_d = INFINITY;
  for (int c = 0; c < 0x80; ++c) {
    const double v = values.v[c];
    if (!std::isfinite(v)) continue;
    const double d = std::fabs(v - a);
    if (d < best_d || (d == best_d && (c & 1) == 0)) {
      best = c;
      best_d = d;
    }
  }
  return sign | static_cast<uint8_t>(best);
}

inline float Bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t ToBf16Truncated(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

// The block rule, in plain loops, over a bf16 tensor.
inline void OracleBlocks(const std::vector<uint16_t>& x, const Fp8BlockShape& shape,
                  const Fp8Spec& s, float max, std::vector<uint8_t>* out,
                  std::vector<float>* scale_inv) {
  out->assign(x.size(), 0);
  scale_inv->clear();
  for (int64_t r0 = 0; r0 < shape.rows; r0 += shape.block_rows) {
    for (int64_t c0 = 0; c0 < shape.cols; c0 += shape.block_cols) {
      const int64_t r1 = std::min(shape.rows, r0 + shape.block_rows);
      const int64_t c1 = std::min(shape.cols, c0 + shape.block_cols);
      float amax = 0;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          amax = std::max(amax, std::fabs(Bf16(x[r * shape.cols + c])));
        }
      }
      if (amax < 1e-4f) amax = 1e-4f;
      const float scale = max / amax;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = Bf16(x[r * shape.cols + c]) * scale;
          (*out)[r * shape.cols + c] = OracleEncode(v, s);
        }
      }
      scale_inv->push_back(amax / max);
    }
  }
}

// "" when `bytes` and `scales` are what the rule gives for the bf16
// tensor `x` quantized to `fp8` (kF8E4M3 or kF8E5M2) in `shape`'s blocks;
// otherwise the first difference and how many bytes differ.
inline std::string DifferenceFromRule(const std::vector<uint16_t>& x,
                                      const Fp8BlockShape& shape, DType fp8,
                                      const std::vector<uint8_t>& bytes,
                                      const std::vector<float>& scales) {
  std::vector<uint8_t> want;
  std::vector<float> want_scales;
  const bool e4m3 = fp8 == DType::kF8E4M3;
  OracleBlocks(x, shape, e4m3 ? kE4M3Spec : kE5M2Spec,
               e4m3 ? 448.0f : 57344.0f, &want, &want_scales);
  if (scales.size() != want_scales.size() || bytes.size() != want.size()) {
    return "sizes differ from the rule's";
  }
  for (size_t i = 0; i < want_scales.size(); ++i) {
    if (std::memcmp(&scales[i], &want_scales[i], 4) != 0) {
      return "scale_inv of block " + std::to_string(i) + " is " +
             std::to_string(scales[i]) + ", the rule gives " +
             std::to_string(want_scales[i]);
    }
  }
  size_t differ = 0, first = 0;
  for (size_t i = want.size(); i-- > 0;) {
    if (bytes[i] != want[i]) {
      ++differ;
      first = i;
    }
  }
  if (differ == 0) return "";
  return std::to_string(differ) + " bytes differ from the rule's; the first, " +
         "element " + std::to_string(first) + ", is " +
         std::to_string(bytes[first]) + " where the rule gives " +
         std::to_string(want[first]);
}

}  // namespace fp8_oracle
}  // namespace ferry

#endif  // FERRY_TESTS_CORE_FP8_ORACLE_H_
