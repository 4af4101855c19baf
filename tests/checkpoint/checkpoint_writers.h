// Writers of small checkpoint files for tests, written from the formats'
// specifications (not from a library): GGUF v3 with metadata of every value
// type and tensors, and safetensors. Plus ggml's reference quantization of
// known floats into Q8_0 and Q4_0 blocks (ggml-quants.c block layouts:
// Q8_0 = f16 scale + 32 int8, Q4_0 = f16 scale + 16 bytes of nibbles, low
// nibbles the first 16 values), and their dequantization, so that a test
// can check bytes against the floats they encode. The K-quants Q4_K
// (144-byte blocks of 256: f16 d, f16 dmin, 12 bytes of 6-bit scales and
// mins for 8 sub-blocks of 32, 128 bytes of nibbles) and Q6_K (210-byte
// blocks of 256: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
// scales for sub-blocks of 16, f16 d) are quantized with a plain min/max
// fit (not ggml's iterative search) into ggml's block layouts, and
// dequantized as ggml's reference dequantizers read them.
#ifndef FERRY_TESTS_CHECKPOINT_CHECKPOINT_WRITERS_H_
#define FERRY_TESTS_CHECKPOINT_CHECKPOINT_WRITERS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {
namespace testing {

using Bytes = std::vector<uint8_t>;

uint16_t FloatToHalf(float f);
float HalfToFloat(uint16_t h);

// `values.size()` a multiple of 32.
Bytes QuantizeQ8_0(const std::vector<float>& values);
Bytes QuantizeQ4_0(const std::vector<float>& values);
std::vector<float> DequantizeQ8_0(const uint8_t* blocks, int64_t values);
std::vector<float> DequantizeQ4_0(const uint8_t* blocks, int64_t values);
// `values.size()` a multiple of 256.
Bytes QuantizeQ4_K(const std::vector<float>& values);
Bytes QuantizeQ6_K(const std::vector<float>& values);
std::vector<float> DequantizeQ4_K(const uint8_t* blocks, int64_t values);
std::vector<float> DequantizeQ6_K(const uint8_t* blocks, int64_t values);

class GgufWriter {
 public:
  explicit GgufWriter(uint32_t version = 3) : version_(version) {}
  // Key/values, in call order. Arrays: element type + raw encoded elements.
  void U8(const std::string& key, uint8_t v);
  void I8(const std::string& key, int8_t v);
  void U16(const std::string& key, uint16_t v);
  void I16(const std::string& key, int16_t v);
  void U32(const std::string& key, uint32_t v);
  void I32(const std::string& key, int32_t v);
  void F32(const std::string& key, float v);
  void Bool(const std::string& key, bool v);
  void String(const std::string& key, const std::string& v);
  void U64(const std::string& key, uint64_t v);
  void I64(const std::string& key, int64_t v);
  void F64(const std::string& key, double v);
  void StringArray(const std::string& key, const std::vector<std::string>& v);
  void I32Array(const std::string& key, const std::vector<int32_t>& v);
  // [[1, 2], [3]] as u32 arrays inside an array.
  void NestedU32Array(const std::string& key,
                      const std::vector<std::vector<uint32_t>>& v);
  // A tensor: ne in GGUF order (ne[0] innermost), its data laid out at the
  // next aligned offset. `offset_override` >= 0 writes that offset instead.
  void Tensor(const std::string& name, uint32_t ggml_type,
              const std::vector<uint64_t>& ne, const Bytes& data,
              int64_t offset_override = -1);
  // The file; `alignment` pads the data section and each tensor.
  Bytes Build(int64_t alignment = 32) const;

 private:
  struct T {
    std::string name;
    uint32_t type;
    std::vector<uint64_t> ne;
    Bytes data;
    int64_t offset_override;
  };
  uint32_t version_;
  uint64_t kv_count_ = 0;
  Bytes kvs_;
  std::vector<T> tensors_;
};

struct SafeTensor {
  std::string name;
  std::string dtype;  // "F32", "BF16", ...
  std::vector<int64_t> shape;
  Bytes data;
};
// A .safetensors file of `tensors` back to back, with `metadata` (may be
// empty) as __metadata__.
Bytes BuildSafetensors(const std::vector<SafeTensor>& tensors,
                       const std::vector<std::pair<std::string, std::string>>&
                           metadata = {});
// The same with the header given verbatim.
Bytes SafetensorsWithHeader(const std::string& header_json, const Bytes& data);

// Writes `bytes` to `path`; REQUIREs success.
void WriteFile(const std::string& path, const Bytes& bytes);
void WriteFile(const std::string& path, const std::string& text);
// A fresh directory under TEST_TMPDIR (or /tmp).
std::string TempDir();

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_CHECKPOINT_CHECKPOINT_WRITERS_H_
