#include "core/fp8_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace ferry {

namespace {

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// A float8 format: exponent bias, mantissa bits, and the byte of its
// largest finite magnitude.
struct Format {
  int bias;
  int mantissa_bits;
  uint8_t max_code;  // without the sign
};

constexpr Format kE4M3{7, 3, 0x7e};  // 1.75 * 2^8 = 448
constexpr Format kE5M2{15, 2, 0x7b};  // 1.75 * 2^15 = 57344

// Round to nearest even onto `f`'s grid, saturating at its largest finite
// magnitude. Bit arithmetic on the float's fields; `a` is finite, >= 0.
uint8_t Encode(float a, const Format& f) {
  const int min_normal_exp = 1 - f.bias;  // e4m3: -6, e5m2: -14
  if (a < std::ldexp(1.0f, min_normal_exp)) {
    // Subnormal: a multiple k of 2^(min_normal_exp - mantissa_bits); k is
    // the code, and k == 2^mantissa_bits is the smallest normal's code.
    const float k = std::nearbyint(
        std::ldexp(a, f.mantissa_bits - min_normal_exp));  // exact scaling
    return static_cast<uint8_t>(k);
  }
  const uint32_t u = Bits(a);
  int exp = static_cast<int>(u >> 23) - 127;
  const uint32_t mant = u & 0x7fffff;
  const int drop = 23 - f.mantissa_bits;
  uint32_t m = mant >> drop;
  const uint32_t rest = mant & ((1u << drop) - 1);
  const uint32_t half = 1u << (drop - 1);
  if (rest > half || (rest == half && (m & 1))) ++m;
  if (m == (1u << f.mantissa_bits)) {
    m = 0;
    ++exp;
  }
  const int e = exp + f.bias;
  const uint32_t code =
      (static_cast<uint32_t>(e) << f.mantissa_bits) | m;
  if (e > (0x7f >> f.mantissa_bits) || code > f.max_code) return f.max_code;
  return static_cast<uint8_t>(code);
}

uint8_t ToFp8(float x, const Format& f) {
  const uint8_t sign = (Bits(x) >> 31) ? 0x80 : 0x00;
  if (std::isnan(x)) return sign | 0x7f;  // e4m3fn's NaN; e5m2's too
  const float a = std::fabs(x);
  if (std::isinf(a)) return sign | f.max_code;
  return sign | Encode(a, f);
}

float FromFp8(uint8_t b, const Format& f) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int e = (b & 0x7f) >> f.mantissa_bits;
  const int m = b & ((1 << f.mantissa_bits) - 1);
  if (f.bias == 7 && (b & 0x7f) == 0x7f) return std::nanf("");
  if (f.bias == 15 && e == 31) {
    return m == 0 ? sign * INFINITY : std::nanf("");
  }
  if (e == 0) return sign * std::ldexp(static_cast<float>(m), 1 - f.bias - f.mantissa_bits);
  return sign * std::ldexp(1.0f + std::ldexp(static_cast<float>(m), -f.mantissa_bits),
                           e - f.bias);
}

float Bf16ToFloat(uint16_t h) { return FromBits(static_cast<uint32_t>(h) << 16); }

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int e = (h >> 10) & 0x1f;
  const uint32_t m = h & 0x3ff;
  if (e == 0x1f) return FromBits(sign | 0x7f800000 | (m << 13));  // inf, NaN
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  return FromBits(sign | (static_cast<uint32_t>(e - 15 + 127) << 23) | (m << 13));
}

// Element i of a source tensor, as float32 (exact for all three dtypes).
float Load(const void* src, DType dtype, int64_t i) {
  switch (dtype) {
    case DType::kF32:
      return static_cast<const float*>(src)[i];
    case DType::kBF16:
      return Bf16ToFloat(static_cast<const uint16_t*>(src)[i]);
    default:
      return F16ToFloat(static_cast<const uint16_t*>(src)[i]);
  }
}

}  // namespace

uint8_t FloatToE4M3(float x) { return ToFp8(x, kE4M3); }
uint8_t FloatToE5M2(float x) { return ToFp8(x, kE5M2); }
float E4M3ToFloat(uint8_t b) { return FromFp8(b, kE4M3); }
float E5M2ToFloat(uint8_t b) { return FromFp8(b, kE5M2); }

float Fp8Max(DType fp8) {
  return fp8 == DType::kF8E5M2 ? 57344.0f : 448.0f;
}

absl::Status CheckFp8BlockArguments(DType src_dtype,
                                    const Fp8BlockShape& shape, DType fp8) {
  if (src_dtype != DType::kF32 && src_dtype != DType::kF16 &&
      src_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 block quantization reads f32, f16 or bf16, not ",
        DTypeName(src_dtype)));
  }
  if (fp8 != DType::kF8E4M3 && fp8 != DType::kF8E5M2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 block quantization writes f8_e4m3 or f8_e5m2, not ",
        DTypeName(fp8)));
  }
  if (shape.rows < 0 || shape.cols < 0 || shape.block_rows <= 0 ||
      shape.block_cols <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 block quantization of [", shape.rows, ", ", shape.cols,
        "] in ", shape.block_rows, "x", shape.block_cols,
        " blocks: dimensions must be >= 0 and blocks > 0"));
  }
  return absl::OkStatus();
}

absl::Status QuantizeBlocks(const void* src, DType src_dtype,
                            const Fp8BlockShape& shape, DType fp8,
                            uint8_t* out, float* scale_inv) {
  if (absl::Status s = CheckFp8BlockArguments(src_dtype, shape, fp8);
      !s.ok()) {
    return s;
  }
  const Format& f = fp8 == DType::kF8E4M3 ? kE4M3 : kE5M2;
  const float max = Fp8Max(fp8);
  const int64_t grid_cols = shape.block_grid_cols();
  for (int64_t br = 0; br < shape.block_grid_rows(); ++br) {
    const int64_t r0 = br * shape.block_rows;
    const int64_t r1 = std::min(shape.rows, r0 + shape.block_rows);
    for (int64_t bc = 0; bc < grid_cols; ++bc) {
      const int64_t c0 = bc * shape.block_cols;
      const int64_t c1 = std::min(shape.cols, c0 + shape.block_cols);
      float amax = 0.0f;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float a = std::fabs(Load(src, src_dtype, r * shape.cols + c));
          // NaN propagates, as torch's amax does: the block's scale is NaN.
          amax = std::isnan(a) ? a : std::max(amax, a);
        }
      }
      amax = std::max(amax, 1e-4f);
      const float scale = max / amax;
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const int64_t i = r * shape.cols + c;
          out[i] = ToFp8(Load(src, src_dtype, i) * scale, f);
        }
      }
      scale_inv[br * grid_cols + bc] = amax / max;
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
