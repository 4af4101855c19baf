#include "core/fp8_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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
  if (e == 0)
    return sign *
           std::ldexp(static_cast<float>(m), 1 - f.bias - f.mantissa_bits);
  return sign *
         std::ldexp(1.0f + std::ldexp(static_cast<float>(m), -f.mantissa_bits),
                    e - f.bias);
}

float Bf16ToFloat(uint16_t h) {
  return FromBits(static_cast<uint32_t>(h) << 16);
}

float F16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int e = (h >> 10) & 0x1f;
  const uint32_t m = h & 0x3ff;
  if (e == 0x1f) return FromBits(sign | 0x7f800000 | (m << 13));  // inf, NaN
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  return FromBits(sign | (static_cast<uint32_t>(e - 15 + 127) << 23) |
                  (m << 13));
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
  const uint32_t rounded = a + ((1u << (kShift - 1)) - 1) + ((a >> kShift) & 1);
  const uint32_t normal = (rounded >> kShift) -
                          (static_cast<uint32_t>(127 - kBias) << kMantissaBits);
  const uint32_t subnormal =
      Bits(FromBits(a) * kSubnormalScale + 8388608.0f) - 0x4b000000u;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(a < kMinNormal);
  const uint32_t code =
      std::min((subnormal & is_subnormal) | (normal & ~is_subnormal), kMaxCode);
  return static_cast<uint8_t>(code | sign);
}

// Any float: NaN stays NaN (0x7f with its sign, e4m3fn's NaN and one of
// e5m2's), everything else as EncodeFinite.
template <DType kFp8>
uint8_t ToFp8(float x) {
  if (std::isnan(x))
    return static_cast<uint8_t>(((Bits(x) >> 24) & 0x80) | 0x7f);
  return EncodeFinite<kFp8>(x);
}

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

#if defined(__x86_64__)
// bf16 rows with AVX2, where the CPU has it (x86-64's baseline is SSE2,
// which has no unsigned 32-bit min or max: GCC's vectorized loops above
// then emulate them). The same rule on the same bits as EncodeFinite, 8
// elements a step, with the subnormal path only for steps that have a
// subnormal (or zero) element; fp8_blocks_test checks every bf16 value's
// byte through it against the oracle.
#define FERRY_AVX2 __attribute__((target("avx2")))

FERRY_AVX2 uint32_t RowAbsMaxBitsBf16Avx2(const uint16_t* s, int n) {
  __m256i m = _mm256_setzero_si256();
  const __m256i abs = _mm256_set1_epi16(0x7fff);
  int c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m256i h =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + c));
    m = _mm256_max_epu16(m, _mm256_and_si256(h, abs));
  }
  alignas(32) uint16_t lanes[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), m);
  uint32_t best = 0;
  for (uint16_t l : lanes) best = std::max<uint32_t>(best, l);
  for (; c < n; ++c) best = std::max<uint32_t>(best, s[c] & 0x7fffu);
  return best << 16;
}

// Eight products, encoded as 32-bit codes (sign included).
template <DType kFp8>
FERRY_AVX2 __m256i EncodeFinite8(__m256 v) {
  constexpr Format kF = FormatOf(kFp8);
  constexpr int kShift = 23 - kF.mantissa_bits;
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - kF.bias) << 23;
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign =
      _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
  const __m256i rounded = _mm256_add_epi32(
      _mm256_add_epi32(a, _mm256_set1_epi32((1 << (kShift - 1)) - 1)),
      _mm256_and_si256(_mm256_srli_epi32(a, kShift), _mm256_set1_epi32(1)));
  __m256i code =
      _mm256_sub_epi32(_mm256_srli_epi32(rounded, kShift),
                       _mm256_set1_epi32((127 - kF.bias) << kF.mantissa_bits));
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(kMinNormal), a);
  if (!_mm256_testz_si256(small, small)) {
    const float kScale =
        static_cast<float>(1u << (kF.bias - 1 + kF.mantissa_bits));
    const __m256 sub = _mm256_add_ps(
        _mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(kScale)),
        _mm256_set1_ps(8388608.0f));
    const __m256i subnormal = _mm256_sub_epi32(_mm256_castps_si256(sub),
                                               _mm256_set1_epi32(0x4b000000));
    code = _mm256_blendv_epi8(code, subnormal, small);
  }
  code = _mm256_min_epu32(code, _mm256_set1_epi32(kF.max_code));
  return _mm256_or_si256(code, sign);
}

template <DType kFp8>
FERRY_AVX2 __m256i Bf16Encoded8(const uint16_t* s, __m256 scale) {
  const __m256i h = _mm256_cvtepu16_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  const __m256 x = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
  return EncodeFinite8<kFp8>(_mm256_mul_ps(x, scale));
}

template <DType kFp8>
FERRY_AVX2 void EncodeRowBf16Avx2(const uint16_t* s, float scale, uint8_t* o,
                                  int n) {
  const __m256 vs = _mm256_set1_ps(scale);
  // packus works within 128-bit lanes: this puts the 32 bytes back in order.
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  int c = 0;
  for (; c + 32 <= n; c += 32) {
    const __m256i c0 = Bf16Encoded8<kFp8>(s + c, vs);
    const __m256i c1 = Bf16Encoded8<kFp8>(s + c + 8, vs);
    const __m256i c2 = Bf16Encoded8<kFp8>(s + c + 16, vs);
    const __m256i c3 = Bf16Encoded8<kFp8>(s + c + 24, vs);
    const __m256i bytes = _mm256_packus_epi16(_mm256_packus_epi32(c0, c1),
                                              _mm256_packus_epi32(c2, c3));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                        _mm256_permutevar8x32_epi32(bytes, order));
  }
  for (; c < n; ++c) {
    o[c] = EncodeFinite<kFp8>(Bf16ToFloat(s[c]) * scale);
  }
}
#undef FERRY_AVX2

bool HasAvx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#else
bool HasAvx2() { return false; }
#endif

// A block's amax from its max |x|'s bits: clamped below at 1e-4; NaN
// propagates, as torch's amax does (the block's scale is NaN).
float ClampedAmax(uint32_t m) {
  return m > 0x7f800000u ? FromBits(m) : std::max(FromBits(m), 1e-4f);
}

// The row routines for kSrc and kFp8: AVX2 for bf16 where the CPU has it.
template <DType kSrc, DType kFp8>
struct Rows {
  uint32_t (*abs_max_bits)(const SourceT<kSrc>*, int) = RowAbsMaxBits<kSrc>;
  void (*encode)(const SourceT<kSrc>*, float, uint8_t*,
                 int) = EncodeRow<kSrc, kFp8>;

  Rows() {
#if defined(__x86_64__)
    if constexpr (kSrc == DType::kBF16) {
      if (HasAvx2()) {
        abs_max_bits = RowAbsMaxBitsBf16Avx2;
        encode = EncodeRowBf16Avx2<kFp8>;
      }
    }
#endif
  }
};

// Quantizes a band of block rows at a time: every block's amax first,
// reading each row whole and left to right (the order the prefetchers
// follow; a block at a time jumped a row's length for each of its rows),
// then the elements, the band still in cache. A band of 128 rows of a
// [7168, 2048] bf16 weight is 512 KiB.
//
// `given` (null: read from `src`): every block's max |x| as bits, combined
// over the nodes that hold parts of the tensor (QuantizeBlocksWithAmax).
// `range`: the rows of the tensor `src` and `out` hold (row-major, from
// their first row); a range that does not start and end on block rows
// needs `given`. `scale_inv` (the whole grid) may be null.
struct RowRange {
  int64_t first = 0;
  int64_t count = 0;
};

template <DType kSrc, DType kFp8>
void QuantizeAll(const void* src, const Fp8BlockShape& shape, RowRange range,
                 const uint32_t* given, uint8_t* out, float* scale_inv) {
  constexpr float kMax = kFp8 == DType::kF8E4M3 ? 448.0f : 57344.0f;
  static const Rows<kSrc, kFp8> rows;
  // Row r of the tensor is row r - range.first of `src` and `out`.
  const auto* base = static_cast<const SourceT<kSrc>*>(src);
  const int64_t grid_cols = shape.block_grid_cols();
  std::vector<uint32_t> max_bits(grid_cols);
  std::vector<float> scale(grid_cols), inv(grid_cols);
  auto width = [&](int64_t bc) {
    return static_cast<int>(std::min(shape.cols, (bc + 1) * shape.block_cols) -
                            bc * shape.block_cols);
  };
  const int64_t end = range.first + range.count;
  for (int64_t br = range.first / shape.block_rows;
       range.count > 0 && br * shape.block_rows < end; ++br) {
    const int64_t r0 = std::max(br * shape.block_rows, range.first);
    const int64_t r1 = std::min(end, (br + 1) * shape.block_rows);
    if (given != nullptr) {
      std::copy(given + br * grid_cols, given + (br + 1) * grid_cols,
                max_bits.begin());
    } else {
      std::fill(max_bits.begin(), max_bits.end(), 0u);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t bc = 0; bc < grid_cols; ++bc) {
          max_bits[bc] =
              std::max(max_bits[bc],
                       rows.abs_max_bits(base + (r - range.first) * shape.cols +
                                             bc * shape.block_cols,
                                         width(bc)));
        }
      }
    }
    for (int64_t bc = 0; bc < grid_cols; ++bc) {
      const float amax = ClampedAmax(max_bits[bc]);
      scale[bc] = kMax / amax;
      inv[bc] = amax / kMax;
      if (scale_inv != nullptr) scale_inv[br * grid_cols + bc] = inv[bc];
    }
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t bc = 0; bc < grid_cols; ++bc) {
        const int64_t first =
            (r - range.first) * shape.cols + bc * shape.block_cols;
        const int w = width(bc);
        if (!std::isfinite(inv[bc])) {
          // NaN or inf elements: the careful path.
          for (int c = 0; c < w; ++c) {
            out[first + c] =
                ToFp8<kFp8>(Load<kSrc>(base + first, c) * scale[bc]);
          }
          continue;
        }
        rows.encode(base + first, scale[bc], out + first, w);
      }
    }
  }
}

template <DType kSrc>
void QuantizeAllTo(DType fp8, const void* src, const Fp8BlockShape& shape,
                   RowRange range, const uint32_t* given, uint8_t* out,
                   float* scale_inv) {
  if (fp8 == DType::kF8E4M3) {
    QuantizeAll<kSrc, DType::kF8E4M3>(src, shape, range, given, out, scale_inv);
  } else {
    QuantizeAll<kSrc, DType::kF8E5M2>(src, shape, range, given, out, scale_inv);
  }
}

// Raises each block's max |x| bits to its rows in `range` (held at `src`
// from the range's first row), rows read whole as QuantizeAll reads them.
template <DType kSrc>
void AbsMaxAll(const void* src, const Fp8BlockShape& shape, RowRange range,
               uint32_t* max_bits) {
  static const Rows<kSrc, DType::kF8E4M3> rows;
  const auto* base = static_cast<const SourceT<kSrc>*>(src);
  const int64_t grid_cols = shape.block_grid_cols();
  const int64_t end = range.first + range.count;
  for (int64_t br = range.first / shape.block_rows;
       range.count > 0 && br * shape.block_rows < end; ++br) {
    uint32_t* out = max_bits + br * grid_cols;
    const int64_t r0 = std::max(br * shape.block_rows, range.first);
    const int64_t r1 = std::min(end, (br + 1) * shape.block_rows);
    for (int64_t r = r0; r < r1; ++r) {
      for (int64_t bc = 0; bc < grid_cols; ++bc) {
        const int64_t c0 = bc * shape.block_cols;
        const int w =
            static_cast<int>(std::min(shape.cols, c0 + shape.block_cols) - c0);
        out[bc] = std::max(
            out[bc],
            rows.abs_max_bits(base + (r - range.first) * shape.cols + c0, w));
      }
    }
  }
}

}  // namespace

uint8_t FloatToE4M3(float x) { return ToFp8<DType::kF8E4M3>(x); }
uint8_t FloatToE5M2(float x) { return ToFp8<DType::kF8E5M2>(x); }
float E4M3ToFloat(uint8_t b) { return FromFp8(b, FormatOf(DType::kF8E4M3)); }
float E5M2ToFloat(uint8_t b) { return FromFp8(b, FormatOf(DType::kF8E5M2)); }

float Fp8Max(DType fp8) { return fp8 == DType::kF8E5M2 ? 57344.0f : 448.0f; }

absl::Status CheckFp8BlockArguments(DType src_dtype, const Fp8BlockShape& shape,
                                    DType fp8) {
  if (src_dtype != DType::kF32 && src_dtype != DType::kF16 &&
      src_dtype != DType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 block quantization reads f32, f16 or bf16, not ",
                     DTypeName(src_dtype)));
  }
  if (fp8 != DType::kF8E4M3 && fp8 != DType::kF8E5M2) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 block quantization writes f8_e4m3 or f8_e5m2, not ",
                     DTypeName(fp8)));
  }
  if (shape.rows < 0 || shape.cols < 0 || shape.block_rows <= 0 ||
      shape.block_cols <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "FP8 block quantization of [", shape.rows, ", ", shape.cols, "] in ",
        shape.block_rows, "x", shape.block_cols,
        " blocks: dimensions must be >= 0 and blocks > 0"));
  }
  return absl::OkStatus();
}

float Fp8ScaleInv(uint32_t max_bits, DType fp8) {
  return ClampedAmax(max_bits) / Fp8Max(fp8);
}

absl::Status QuantizeBlocks(const void* src, DType src_dtype,
                            const Fp8BlockShape& shape, DType fp8, uint8_t* out,
                            float* scale_inv) {
  return QuantizeBlocksWithAmax(src, src_dtype, shape, fp8, nullptr, out,
                                scale_inv);
}

absl::Status QuantizeBlocksWithAmax(const void* src, DType src_dtype,
                                    const Fp8BlockShape& shape, DType fp8,
                                    const uint32_t* max_bits, uint8_t* out,
                                    float* scale_inv) {
  return QuantizeRows(src, src_dtype, shape, 0, shape.rows, fp8, max_bits, out,
                      scale_inv);
}

absl::Status QuantizeRows(const void* src, DType src_dtype,
                          const Fp8BlockShape& shape, int64_t first_row,
                          int64_t rows, DType fp8, const uint32_t* max_bits,
                          uint8_t* out, float* scale_inv) {
  if (absl::Status s = CheckFp8BlockArguments(src_dtype, shape, fp8); !s.ok()) {
    return s;
  }
  const RowRange range{first_row, rows};
  if (first_row < 0 || rows < 0 || first_row > shape.rows - rows ||
      (max_bits == nullptr && (first_row != 0 || rows != shape.rows))) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 block quantization of rows [", first_row, ", ",
                     first_row + rows, ") of ", shape.rows,
                     ": a range inside the tensor, and the whole "
                     "tensor unless the block amaxes are given"));
  }
  switch (src_dtype) {
    case DType::kF32:
      QuantizeAllTo<DType::kF32>(fp8, src, shape, range, max_bits, out,
                                 scale_inv);
      break;
    case DType::kF16:
      QuantizeAllTo<DType::kF16>(fp8, src, shape, range, max_bits, out,
                                 scale_inv);
      break;
    default:
      QuantizeAllTo<DType::kBF16>(fp8, src, shape, range, max_bits, out,
                                  scale_inv);
      break;
  }
  return absl::OkStatus();
}

absl::Status BlockAbsMaxBits(const void* src, DType src_dtype,
                             const Fp8BlockShape& shape, uint32_t* max_bits) {
  std::fill(max_bits,
            max_bits + shape.block_grid_rows() * shape.block_grid_cols(), 0u);
  return RaiseRowsAbsMaxBits(src, src_dtype, shape, 0, shape.rows, max_bits);
}

absl::Status RaiseRowsAbsMaxBits(const void* src, DType src_dtype,
                                 const Fp8BlockShape& shape, int64_t first_row,
                                 int64_t rows, uint32_t* max_bits) {
  if (absl::Status s = CheckFp8BlockArguments(src_dtype, shape, DType::kF8E4M3);
      !s.ok()) {
    return s;
  }
  if (first_row < 0 || rows < 0 || first_row > shape.rows - rows) {
    return absl::InvalidArgumentError(
        absl::StrCat("FP8 block amaxes of rows [", first_row, ", ",
                     first_row + rows, ") of ", shape.rows));
  }
  const RowRange range{first_row, rows};
  switch (src_dtype) {
    case DType::kF32:
      AbsMaxAll<DType::kF32>(src, shape, range, max_bits);
      break;
    case DType::kF16:
      AbsMaxAll<DType::kF16>(src, shape, range, max_bits);
      break;
    default:
      AbsMaxAll<DType::kBF16>(src, shape, range, max_bits);
      break;
  }
  return absl::OkStatus();
}

}  // namespace ferry
