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
