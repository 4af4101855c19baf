// GGUF v3 (llama.cpp / ggml), read from the format's specification. All
// little-endian:
//
//   "GGUF" u32 version (2 or 3: the same layout) u64 tensor_count
//   u64 kv_count, kv_count x {string key, u32 type, value}, tensor_count x
//   {string name, u32 n_dims, u64 ne[n_dims], u32 ggml_type, u64 offset},
//   padding to `general.alignment` (default 32), the data section.
//
// A string is u64 length + bytes; a value is one of the 13 GGUF types
// (u8 i8 u16 i16 u32 i32 f32 bool string array u64 i64 f64); an array is
// u32 element type + u64 count + elements (arrays of arrays allowed).
// ne[0] is the innermost dimension: the row-major shape ferry uses is ne
// reversed. Tensor offsets are relative to the data section and aligned.
//
// ggml types read: F32, F16, BF16 and the block formats Q4_0, Q4_1, Q5_0,
// Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K (core/dtype.h has their block
// geometry). Checked, each an error naming the file, the tensor and the
// byte offset: truncation anywhere, magic, version, counts and string
// lengths that cannot fit in the file, 0 or more than 4 dims, an unknown
// ggml type, ne[0] not a whole number of blocks, misaligned offsets, data
// past the end of the file, two tensors sharing bytes, duplicate names.
#ifndef FERRY_CHECKPOINT_GGUF_H_
#define FERRY_CHECKPOINT_GGUF_H_

#include <cstdint>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"

namespace ferry {

enum class GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6,
  kBool = 7, kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

// One metadata value: a scalar (integers widened, floats as double), a
// string, or an array of values.
struct GgufValue {
  GgufType type = GgufType::kU8;
  std::variant<uint64_t, int64_t, double, bool, std::string,
               std::vector<GgufValue>>
      value;
};

struct GgufFile {
  uint32_t version = 0;
  int64_t alignment = 32;
  int64_t data_offset = 0;  // absolute byte where the data section starts
  std::map<std::string, GgufValue> metadata;
  // Tensors (file_type: "Q4_K", ...) in the order of their tensor infos;
  // metadata scalars and strings as text in checkpoint.metadata.
  Checkpoint checkpoint;
};

// ggml type number -> ferry dtype and name ("Q4_K"); NOT_FOUND for a type
// ferry does not read (IQ formats, Q8_K, F64...).
absl::StatusOr<DType> DTypeOfGgmlType(uint32_t ggml_type, std::string* name);

absl::StatusOr<GgufFile> ReadGguf(const std::string& path);

}  // namespace ferry

#endif  // FERRY_CHECKPOINT_GGUF_H_
