#include "tests/checkpoint/checkpoint_writers.h"

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"

namespace ferry {
namespace testing {
namespace {

void Put(Bytes* out, const void* p, size_t n) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  out->insert(out->end(), b, b + n);
}
template <typename T>
void PutV(Bytes* out, T v) {
  Put(out, &v, sizeof(T));
}
void PutString(Bytes* out, const std::string& s) {
  PutV<uint64_t>(out, s.size());
  Put(out, s.data(), s.size());
}

}  // namespace

uint16_t FloatToHalf(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (exp <= 0) {  // subnormal or zero
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const uint32_t shift = static_cast<uint32_t>(14 - exp);
    uint32_t half = mant >> shift;
    if ((mant >> (shift - 1)) & 1) ++half;  // round half up
    return static_cast<uint16_t>(sign | half);
  }
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  uint32_t half = sign | (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  if (mant & 0x1000) ++half;  // round half up (carries into the exponent)
  return static_cast<uint16_t>(half);
}

float HalfToFloat(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t mant = h & 0x3ff;
  float f;
  if (exp == 0) {
    f = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -f : f;
  }
  const uint32_t x = exp == 31 ? sign | 0x7f800000u | (mant << 13)
                               : sign | ((exp - 15 + 127) << 23) | (mant << 13);
  std::memcpy(&f, &x, 4);
  return f;
}

Bytes QuantizeQ8_0(const std::vector<float>& v) {
  Bytes out;
  for (size_t b = 0; b < v.size(); b += 32) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(v[b + j]));
    const float d = amax / 127.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    PutV<uint16_t>(&out, FloatToHalf(d));
    for (int j = 0; j < 32; ++j) {
      PutV<int8_t>(&out, static_cast<int8_t>(std::lround(v[b + j] * id)));
    }
  }
  return out;
}

Bytes QuantizeQ4_0(const std::vector<float>& v) {
  Bytes out;
  for (size_t b = 0; b < v.size(); b += 32) {
    float amax = 0, max = 0;
    for (int j = 0; j < 32; ++j) {
      if (std::fabs(v[b + j]) > amax) {
        amax = std::fabs(v[b + j]);
        max = v[b + j];
      }
    }
    const float d = max / -8.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    PutV<uint16_t>(&out, FloatToHalf(d));
    for (int j = 0; j < 16; ++j) {
      const int q0 = std::min(15, static_cast<int>(v[b + j] * id + 8.5f));
      const int q1 = std::min(15, static_cast<int>(v[b + j + 16] * id + 8.5f));
      PutV<uint8_t>(&out, static_cast<uint8_t>(q0 | (q1 << 4)));
    }
  }
  return out;
}

std::vector<float> DequantizeQ8_0(const uint8_t* blocks, int64_t values) {
  std::vector<float> out;
  for (int64_t b = 0; b < values / 32; ++b) {
    const uint8_t* blk = blocks + b * 34;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const float d = HalfToFloat(h);
    for (int j = 0; j < 32; ++j) {
      out.push_back(d * static_cast<int8_t>(blk[2 + j]));
    }
  }
  return out;
}

std::vector<float> DequantizeQ4_0(const uint8_t* blocks, int64_t values) {
  std::vector<float> out(values);
  for (int64_t b = 0; b < values / 32; ++b) {
    const uint8_t* blk = blocks + b * 18;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const float d = HalfToFloat(h);
    for (int j = 0; j < 16; ++j) {
      out[b * 32 + j] = ((blk[2 + j] & 0x0f) - 8) * d;
      out[b * 32 + j + 16] = ((blk[2 + j] >> 4) - 8) * d;
    }
  }
  return out;
}

Bytes QuantizeQ4_K(const std::vector<float>& v) {
  Bytes out;
  for (size_t b = 0; b < v.size(); b += 256) {
    // Per sub-block of 32: y = scale * q - min, q in 0..15, min >= 0.
    float scale[8], min[8], max_scale = 0, max_min = 0;
    for (int j = 0; j < 8; ++j) {
      float lo = 0, hi = 0;
      for (int l = 0; l < 32; ++l) {
        lo = std::min(lo, v[b + 32 * j + l]);
        hi = std::max(hi, v[b + 32 * j + l]);
      }
      scale[j] = (hi - lo) / 15.0f;
      min[j] = -lo;
      max_scale = std::max(max_scale, scale[j]);
      max_min = std::max(max_min, min[j]);
    }
    // The super-block scales (f16) and 6-bit sub-block scales and mins.
    const uint16_t d_half = FloatToHalf(max_scale / 63.0f);
    const uint16_t dmin_half = FloatToHalf(max_min / 63.0f);
    const float d = HalfToFloat(d_half), dmin = HalfToFloat(dmin_half);
    uint8_t ls[8], lm[8];
    for (int j = 0; j < 8; ++j) {
      ls[j] = d > 0 ? static_cast<uint8_t>(std::min(63L, std::lround(scale[j] / d))) : 0;
      lm[j] = dmin > 0 ? static_cast<uint8_t>(std::min(63L, std::lround(min[j] / dmin))) : 0;
    }
    // ggml's packing: sub-blocks 0-3 in the low 6 bits of bytes 0-3
    // (scales) and 4-7 (mins); 4-7 in the nibbles of bytes 8-11, their top
    // 2 bits in the top bits of bytes 0-7.
    uint8_t scales[12] = {0};
    for (int j = 0; j < 8; ++j) {
      if (j < 4) {
        scales[j] = ls[j];
        scales[j + 4] = lm[j];
      } else {
        scales[j + 4] = static_cast<uint8_t>((ls[j] & 0xf) | ((lm[j] & 0xf) << 4));
        scales[j - 4] |= static_cast<uint8_t>((ls[j] >> 4) << 6);
        scales[j] |= static_cast<uint8_t>((lm[j] >> 4) << 6);
      }
    }
    uint8_t q[256];
    for (int j = 0; j < 8; ++j) {
      const float sc = d * ls[j], m = dmin * lm[j];
      for (int l = 0; l < 32; ++l) {
        const float x = v[b + 32 * j + l];
        q[32 * j + l] = sc > 0 ? static_cast<uint8_t>(std::clamp(
                                     std::lround((x + m) / sc), 0L, 15L))
                               : 0;
      }
    }
    PutV<uint16_t>(&out, d_half);
    PutV<uint16_t>(&out, dmin_half);
    Put(&out, scales, 12);
    // Each 32 bytes hold 64 values: the first 32 in the low nibbles.
    for (int chunk = 0; chunk < 4; ++chunk) {
      for (int l = 0; l < 32; ++l) {
        PutV<uint8_t>(&out, static_cast<uint8_t>(q[64 * chunk + l] |
                                                 (q[64 * chunk + 32 + l] << 4)));
      }
    }
  }
  return out;
}

std::vector<float> DequantizeQ4_K(const uint8_t* blocks, int64_t values) {
  std::vector<float> out;
  for (int64_t b = 0; b < values / 256; ++b) {
    const uint8_t* blk = blocks + b * 144;
    uint16_t h;
    std::memcpy(&h, blk, 2);
    const float d = HalfToFloat(h);
    std::memcpy(&h, blk + 2, 2);
    const float dmin = HalfToFloat(h);
    const uint8_t* sc = blk + 4;
    auto scale_min = [&](int j, int* s, int* m) {
      if (j < 4) {
        *s = sc[j] & 63;
        *m = sc[j + 4] & 63;
      } else {
        *s = (sc[j + 4] & 0xf) | ((sc[j - 4] >> 6) << 4);
        *m = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
      }
    };
    const uint8_t* qs = blk + 16;
    for (int chunk = 0; chunk < 4; ++chunk) {
      int s0, m0, s1, m1;
      scale_min(2 * chunk, &s0, &m0);
      scale_min(2 * chunk + 1, &s1, &m1);
      for (int l = 0; l < 32; ++l) out.push_back(d * s0 * (qs[l] & 0xf) - dmin * m0);
      for (int l = 0; l < 32; ++l) out.push_back(d * s1 * (qs[l] >> 4) - dmin * m1);
      qs += 32;
    }
  }
  return out;
}

Bytes QuantizeQ6_K(const std::vector<float>& v) {
  Bytes out;
  for (size_t b = 0; b < v.size(); b += 256) {
    // Per sub-block of 16: y = d * scale * (q - 32), q in 0..63.
    float scale[16], max_abs_scale = 0;
    for (int j = 0; j < 16; ++j) {
      float amax = 0;
      for (int l = 0; l < 16; ++l) amax = std::max(amax, std::fabs(v[b + 16 * j + l]));
      scale[j] = amax / 31.0f;
      max_abs_scale = std::max(max_abs_scale, scale[j]);
    }
    const uint16_t d_half = FloatToHalf(max_abs_scale / 127.0f);
    const float d = HalfToFloat(d_half);
    int8_t sc[16];
    uint8_t L[256];
    for (int j = 0; j < 16; ++j) {
      sc[j] = d > 0 ? static_cast<int8_t>(std::min(127L, std::lround(scale[j] / d))) : 0;
      const float s = d * sc[j];
      for (int l = 0; l < 16; ++l) {
        const long q = s > 0 ? std::clamp(std::lround(v[b + 16 * j + l] / s), -32L, 31L) : 0;
        L[16 * j + l] = static_cast<uint8_t>(q + 32);
      }
    }
    // ggml's packing, per half of 128 values: ql holds the low nibbles of
    // values l and l+64 (bytes l) and l+32 and l+96 (bytes l+32); qh the
    // top 2 bits of all four in one byte.
    uint8_t ql[128], qh[64];
    for (int half = 0; half < 2; ++half) {
      const uint8_t* x = L + 128 * half;
      for (int l = 0; l < 32; ++l) {
        ql[64 * half + l] = static_cast<uint8_t>((x[l] & 0xf) | ((x[l + 64] & 0xf) << 4));
        ql[64 * half + l + 32] =
            static_cast<uint8_t>((x[l + 32] & 0xf) | ((x[l + 96] & 0xf) << 4));
        qh[32 * half + l] = static_cast<uint8_t>((x[l] >> 4) | ((x[l + 32] >> 4) << 2) |
                                                 ((x[l + 64] >> 4) << 4) |
                                                 ((x[l + 96] >> 4) << 6));
      }
    }
    Put(&out, ql, 128);
    Put(&out, qh, 64);
    Put(&out, sc, 16);
    PutV<uint16_t>(&out, d_half);
  }
  return out;
}

std::vector<float> DequantizeQ6_K(const uint8_t* blocks, int64_t values) {
  std::vector<float> out(values);
  for (int64_t b = 0; b < values / 256; ++b) {
    const uint8_t* blk = blocks + b * 210;
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    uint16_t h;
    std::memcpy(&h, blk + 208, 2);
    const float d = HalfToFloat(h);
    float* y = out.data() + b * 256;
    for (int half = 0; half < 2; ++half) {
      for (int l = 0; l < 32; ++l) {
        const int is = l / 16;
        const int q1 = ((ql[l] & 0xf) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xf) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        y[l] = d * sc[is] * q1;
        y[l + 32] = d * sc[is + 2] * q2;
        y[l + 64] = d * sc[is + 4] * q3;
        y[l + 96] = d * sc[is + 6] * q4;
      }
      y += 128;
      ql += 64;
      qh += 32;
      sc += 8;
    }
  }
  return out;
}

#define FERRY_KV(Name, Type, Code)                           \
  void GgufWriter::Name(const std::string& key, Type v) {   \
    PutString(&kvs_, key);                                  \
    PutV<uint32_t>(&kvs_, Code);                            \
    PutV<Type>(&kvs_, v);                                   \
    ++kv_count_;                                            \
  }
FERRY_KV(U8, uint8_t, 0)
FERRY_KV(I8, int8_t, 1)
FERRY_KV(U16, uint16_t, 2)
FERRY_KV(I16, int16_t, 3)
FERRY_KV(U32, uint32_t, 4)
FERRY_KV(I32, int32_t, 5)
FERRY_KV(F32, float, 6)
FERRY_KV(U64, uint64_t, 10)
FERRY_KV(I64, int64_t, 11)
FERRY_KV(F64, double, 12)
#undef FERRY_KV

void GgufWriter::Bool(const std::string& key, bool v) {
  PutString(&kvs_, key);
  PutV<uint32_t>(&kvs_, 7);
  PutV<uint8_t>(&kvs_, v ? 1 : 0);
  ++kv_count_;
}

void GgufWriter::String(const std::string& key, const std::string& v) {
  PutString(&kvs_, key);
  PutV<uint32_t>(&kvs_, 8);
  PutString(&kvs_, v);
  ++kv_count_;
}

void GgufWriter::StringArray(const std::string& key,
                             const std::vector<std::string>& v) {
  PutString(&kvs_, key);
  PutV<uint32_t>(&kvs_, 9);
  PutV<uint32_t>(&kvs_, 8);
  PutV<uint64_t>(&kvs_, v.size());
  for (const std::string& s : v) PutString(&kvs_, s);
  ++kv_count_;
}

void GgufWriter::I32Array(const std::string& key, const std::vector<int32_t>& v) {
  PutString(&kvs_, key);
  PutV<uint32_t>(&kvs_, 9);
  PutV<uint32_t>(&kvs_, 5);
  PutV<uint64_t>(&kvs_, v.size());
  for (int32_t x : v) PutV<int32_t>(&kvs_, x);
  ++kv_count_;
}

void GgufWriter::NestedU32Array(const std::string& key,
                                const std::vector<std::vector<uint32_t>>& v) {
  PutString(&kvs_, key);
  PutV<uint32_t>(&kvs_, 9);
  PutV<uint32_t>(&kvs_, 9);
  PutV<uint64_t>(&kvs_, v.size());
  for (const auto& inner : v) {
    PutV<uint32_t>(&kvs_, 4);
    PutV<uint64_t>(&kvs_, inner.size());
    for (uint32_t x : inner) PutV<uint32_t>(&kvs_, x);
  }
  ++kv_count_;
}

void GgufWriter::Tensor(const std::string& name, uint32_t ggml_type,
                        const std::vector<uint64_t>& ne, const Bytes& data,
                        int64_t offset_override) {
  tensors_.push_back(T{name, ggml_type, ne, data, offset_override});
}

Bytes GgufWriter::Build(int64_t alignment) const {
  Bytes out;
  Put(&out, "GGUF", 4);
  PutV<uint32_t>(&out, version_);
  PutV<uint64_t>(&out, tensors_.size());
  PutV<uint64_t>(&out, kv_count_);
  out.insert(out.end(), kvs_.begin(), kvs_.end());
  std::vector<uint64_t> offsets;
  uint64_t at = 0;
  for (const T& t : tensors_) {
    offsets.push_back(t.offset_override >= 0 ? t.offset_override : at);
    at += (t.data.size() + alignment - 1) / alignment * alignment;
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const T& t = tensors_[i];
    PutString(&out, t.name);
    PutV<uint32_t>(&out, t.ne.size());
    for (uint64_t n : t.ne) PutV<uint64_t>(&out, n);
    PutV<uint32_t>(&out, t.type);
    PutV<uint64_t>(&out, offsets[i]);
  }
  while (out.size() % alignment != 0) out.push_back(0);
  const size_t data_start = out.size();
  for (size_t i = 0; i < tensors_.size(); ++i) {
    const Bytes& d = tensors_[i].data;
    const size_t want = data_start + offsets[i];
    if (out.size() < want + d.size()) out.resize(want + d.size(), 0);
    std::copy(d.begin(), d.end(), out.begin() + want);
  }
  while (out.size() % alignment != 0) out.push_back(0);
  return out;
}

Bytes SafetensorsWithHeader(const std::string& header, const Bytes& data) {
  Bytes out;
  PutV<uint64_t>(&out, header.size());
  Put(&out, header.data(), header.size());
  out.insert(out.end(), data.begin(), data.end());
  return out;
}

Bytes BuildSafetensors(
    const std::vector<SafeTensor>& tensors,
    const std::vector<std::pair<std::string, std::string>>& metadata) {
  std::string header = "{";
  Bytes data;
  bool first = true;
  if (!metadata.empty()) {
    header += "\"__metadata__\":{";
    for (size_t i = 0; i < metadata.size(); ++i) {
      header += absl::StrCat(i ? "," : "", "\"", metadata[i].first, "\":\"",
                             metadata[i].second, "\"");
    }
    header += "}";
    first = false;
  }
  for (const SafeTensor& t : tensors) {
    std::string shape;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      shape += absl::StrCat(i ? "," : "", t.shape[i]);
    }
    header += absl::StrCat(first ? "" : ",", "\"", t.name, "\":{\"dtype\":\"",
                           t.dtype, "\",\"shape\":[", shape,
                           "],\"data_offsets\":[", data.size(), ",",
                           data.size() + t.data.size(), "]}");
    data.insert(data.end(), t.data.begin(), t.data.end());
    first = false;
  }
  header += "}";
  return SafetensorsWithHeader(header, data);
}

void WriteFile(const std::string& path, const Bytes& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  REQUIRE(f.good());
}

void WriteFile(const std::string& path, const std::string& text) {
  WriteFile(path, Bytes(text.begin(), text.end()));
}

std::string TempDir() {
  const char* base = std::getenv("TEST_TMPDIR");
  std::string t = absl::StrCat(base != nullptr ? base : "/tmp", "/ckptXXXXXX");
  REQUIRE(mkdtemp(t.data()) != nullptr);
  return t;
}

}  // namespace testing
}  // namespace ferry
