#include "core/fp8_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>

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
  uint32_t max_code;  // without the sign
};

constexpr Format FormatOf(DType fp8) {
  return fp8 == DType::kF8E4M3 ? Format{7, 3, 0x7e}    // 1.75 * 2^8 = 448
                               : Format{15, 2, 0x7b};  // 1.75 * 2^15 = 57344
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

// Element i of a source row, as float32 (exact for all three dtypes).
template <DType kSrc, typename T>
float Load(const T* src, int64_t i) {
  if constexpr (kSrc == DType::kF32) {
    return src[i];
  } else if constexpr (kSrc == DType::kBF16) {
    return Bf16ToFloat(src[i]);
  } else {
    return F16ToFloat(src[i]);
  }
}

// v rounded to the nearest even float8 byte, saturating; any v but NaN
// (an infinity saturates too). No branch the compiler cannot turn into a
// select, so the row loops vectorize: the normal range rounds on the
// float's bits (the carry moves into the exponent), the subnormal range
// by adding 2^23 (a float's addition rounds to nearest even at the
// units); both are computed and one is kept.
template <DType kFp8>
uint8_t EncodeFinite(float v) {
  constexpr Format kF = FormatOf(kFp8);
  constexpr int kBias = kF.bias;
  constexpr int kMantissaBits = kF.mantissa_bits;
  constexpr uint32_t kMaxCode = kF.max_code;
  constexpr int kShift = 23 - kMantissaBits;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - kBias) << 23;
  constexpr float kSubnormalScale =
      static_cast<float>(1u << (kBias - 1 + kMantissaBits));  // e4m3: 512
  const uint32_t u = Bits(v);
  const uint32_t sign = (u >> 24) & 0x80;
  const uint32_t a = u & 0x7fffffff;
  const uint32_t rounded =
      a + ((1u << (kShift - 1)) - 1) + ((a >> kShift) & 1);
  const uint32_t normal =
      (rounded >> kShift) - (static_cast<uint32_t>(127 - kBias) << kMantissaBits);
  const uint32_t subnormal =
      Bits(FromBits(a) * kSubnormalScale + 8388608.0f) - 0x4b000000u;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(a < kMinNormal);
  const uint32_t code = std::min(
      (subnormal & is_subnormal) | (normal & ~is_subnormal), kMaxCode);
  return static_cast<uint8_t>(code | sign);
}

// Any float: NaN stays NaN (0x7f with its sign, e4m3fn's NaN and one of
// e5m2's), everything else as EncodeFinite.
template <DType kFp8>
uint8_t ToFp8(float x) {
  if (std::isnan(x)) return static_cast<uint8_t>(((Bits(x) >> 24) & 0x80) | 0x7f);
  return EncodeFinite<kFp8>(x);
}

// One block of a tensor: [r0, r1) x [c0, c1).
struct Block {
  int64_t r0, r1, c0, c1;
};

template <DType kSrc>
using SourceT = std::conditional_t<kSrc == DType::kF32, float, uint16_t>;

// The largest |x| of a row's n elements, as a float's bits: for floats
// >= 0 the bits order as the values do, and any NaN's bits are above
// infinity's, so an integer max finds both (and vectorizes, where a float
// max with NaNs does not).
template <DType kSrc>
uint32_t RowAbsMaxBits(const SourceT<kSrc>* __restrict__ s, int n) {
  uint32_t m = 0;
  for (int c = 0; c < n; ++c) {
    m = std::max(m, Bits(Load<kSrc>(s, c)) & 0x7fffffffu);
  }
  return m;
}

// A row's n elements times `scale`, encoded; every product finite.
template <DType kSrc, DType kFp8>
void EncodeRow(const SourceT<kSrc>* __restrict__ s, float scale,
               uint8_t* __restrict__ o, int n) {
  for (int c = 0; c < n; ++c) {
    const float v = Load<kSrc>(s, c) * scale;
    o[c] = EncodeFinite<kFp8>(v);
  }
}

// Quantizes one block; the scale_inv it stored.
template <DType kSrc, DType kFp8>
float QuantizeBlock(const void* src, int64_t cols, const Block& b,
                    uint8_t* out) {
  constexpr float kMax = kFp8 == DType::kF8E4M3 ? 448.0f : 57344.0f;
  const auto* base = static_cast<const SourceT<kSrc>*>(src);
  const int w = static_cast<int>(b.c1 - b.c0);
  uint32_t max_bits = 0;
  for (int64_t r = b.r0; r < b.r1; ++r) {
    max_bits = std::max(max_bits, RowAbsMaxBits<kSrc>(base + r * cols + b.c0, w));
  }
  // NaN propagates, as torch's amax does: the block's scale is NaN.
  const float amax = max_bits > 0x7f800000u ? FromBits(max_bits)
                                            : std::max(FromBits(max_bits), 1e-4f);
  const float scale = kMax / amax;
  for (int64_t r = b.r0; r < b.r1; ++r) {
    const int64_t first = r * cols + b.c0;
    if (!std::isfinite(amax)) {  // NaN or inf elements: the careful path
      for (int c = 0; c < w; ++c) {
        out[first + c] = ToFp8<kFp8>(Load<kSrc>(base + first, c) * scale);
      }
      continue;
    }
    EncodeRow<kSrc, kFp8>(base + first, scale, out + first, w);
  }
  return amax / kMax;
}

template <DType kSrc, DType kFp8>
void QuantizeAll(const void* src, const Fp8BlockShape& shape, uint8_t* out,
                 float* scale_inv) {
  const int64_t grid_cols = shape.block_grid_cols();
  for (int64_t br = 0; br < shape.block_grid_rows(); ++br) {
    for (int64_t bc = 0; bc < grid_cols; ++bc) {
      Block b{br * shape.block_rows, 0, bc * shape.block_cols, 0};
      b.r1 = std::min(shape.rows, b.r0 + shape.block_rows);
      b.c1 = std::min(shape.cols, b.c0 + shape.block_cols);
      scale_inv[br * grid_cols + bc] =
          QuantizeBlock<kSrc, kFp8>(src, shape.cols, b, out);
    }
  }
}

template <DType kSrc>
void QuantizeAllTo(DType fp8, const void* src, const Fp8BlockShape& shape,
                   uint8_t* out, float* scale_inv) {
  if (fp8 == DType::kF8E4M3) {
    QuantizeAll<kSrc, DType::kF8E4M3>(src, shape, out, scale_inv);
  } else {
    QuantizeAll<kSrc, DType::kF8E5M2>(src, shape, out, scale_inv);
  }
}

}  // namespace

uint8_t FloatToE4M3(float x) { return ToFp8<DType::kF8E4M3>(x); }
uint8_t FloatToE5M2(float x) { return ToFp8<DType::kF8E5M2>(x); }
float E4M3ToFloat(uint8_t b) { return FromFp8(b, FormatOf(DType::kF8E4M3)); }
float E5M2ToFloat(uint8_t b) { return FromFp8(b, FormatOf(DType::kF8E5M2)); }

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
  switch (src_dtype) {
    case DType::kF32:
      QuantizeAllTo<DType::kF32>(fp8, src, shape, out, scale_inv);
      break;
    case DType::kF16:
      QuantizeAllTo<DType::kF16>(fp8, src, shape, out, scale_inv);
      break;
    default:
      QuantizeAllTo<DType::kBF16>(fp8, src, shape, out, scale_inv);
      break;
  }
  return absl::OkStatus();
}

}  // namespace ferry
