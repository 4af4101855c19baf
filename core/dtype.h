// Element types of checkpoint parameters, including block-quantized ones.
//
// A dtype is stored in "units": one element for plain types, one block for
// block-quantized types (GGUF Q4_K: 256 elements in 144 bytes). Shapes and
// boxes are always written in elements, as a checkpoint names them; the
// innermost dimension of a block-quantized tensor must be a whole number of
// blocks, and every box of it must start and end on a block boundary. FP8
// weights with block scales (DeepSeek-V3 style) are plain kF8E4M3 tensors:
// their scales are a separate F32 parameter that is sharded and moved like
// any other.
#ifndef FERRY_CORE_DTYPE_H_
#define FERRY_CORE_DTYPE_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {

enum class DType : uint8_t {
  kInvalid = 0,
  kF32,
  kF16,
  kBF16,
  kF8E4M3,
  kF8E5M2,
  kI8,
  kU8,
  kI32,
  kI64,
  kBool,
  // GGUF block-quantized formats (ggml's block layouts).
  kQ4_0,
  kQ4_1,
  kQ5_0,
  kQ5_1,
  kQ8_0,
  kQ2_K,
  kQ3_K,
  kQ4_K,
  kQ5_K,
  kQ6_K,
};

struct DTypeInfo {
  DType id;
  const char* name;     // canonical lower-case name: "bf16", "q4_k"
  int64_t block_elems;  // elements per storage unit (1 for plain types)
  int64_t block_bytes;  // bytes per storage unit
};

// The last enumerator: a number past it (from a cast or the wire) is no
// dtype, and GetDTypeInfo would read past its table.
inline constexpr DType kLastDType = DType::kQ6_K;

// The one validity rule: a real dtype (not kInvalid, not past kLastDType).
// Everything that takes a dtype from outside checks it with this.
constexpr bool IsValidDType(DType dtype) {
  return dtype != DType::kInvalid &&
         static_cast<uint8_t>(dtype) <= static_cast<uint8_t>(kLastDType);
}
constexpr bool IsValidDTypeNumber(int number) {
  return number > 0 && number <= static_cast<int>(kLastDType);
}

// Block geometry of the GGUF formats follows ggml's block structs:
// Q4_0 = fp16 scale + 16 bytes of nibbles per 32 elements, and so on; the
// K-quants use 256-element super-blocks.
inline constexpr DTypeInfo kDTypeTable[] = {
    {DType::kInvalid, "invalid", 1, 0},
    {DType::kF32, "f32", 1, 4},
    {DType::kF16, "f16", 1, 2},
    {DType::kBF16, "bf16", 1, 2},
    {DType::kF8E4M3, "f8_e4m3", 1, 1},
    {DType::kF8E5M2, "f8_e5m2", 1, 1},
    {DType::kI8, "i8", 1, 1},
    {DType::kU8, "u8", 1, 1},
    {DType::kI32, "i32", 1, 4},
    {DType::kI64, "i64", 1, 8},
    {DType::kBool, "bool", 1, 1},
    {DType::kQ4_0, "q4_0", 32, 18},
    {DType::kQ4_1, "q4_1", 32, 20},
    {DType::kQ5_0, "q5_0", 32, 22},
    {DType::kQ5_1, "q5_1", 32, 24},
    {DType::kQ8_0, "q8_0", 32, 34},
    {DType::kQ2_K, "q2_k", 256, 84},
    {DType::kQ3_K, "q3_k", 256, 110},
    {DType::kQ4_K, "q4_k", 256, 144},
    {DType::kQ5_K, "q5_k", 256, 176},
    {DType::kQ6_K, "q6_k", 256, 210},
};
static_assert(sizeof(kDTypeTable) / sizeof(kDTypeTable[0]) ==
                  static_cast<size_t>(kLastDType) + 1,
              "one entry per dtype");

// REQUIRES: IsValidDType(dtype). Inline: planning asks for a unit's size
// millions of times per plan.
inline const DTypeInfo& GetDTypeInfo(DType dtype) {
  return kDTypeTable[static_cast<size_t>(dtype)];
}

inline bool IsBlockQuantized(DType dtype) {
  return GetDTypeInfo(dtype).block_elems > 1;
}
inline int64_t UnitBytes(DType dtype) { return GetDTypeInfo(dtype).block_bytes; }
inline int64_t BlockElems(DType dtype) {
  return GetDTypeInfo(dtype).block_elems;
}
inline const char* DTypeName(DType dtype) { return GetDTypeInfo(dtype).name; }

// Accepts ferry's names ("bf16", "q4_k"), safetensors codes ("BF16",
// "F8_E4M3") and GGUF names ("Q4_K"), case-insensitively.
absl::StatusOr<DType> ParseDType(absl::string_view name);

}  // namespace ferry

#endif  // FERRY_CORE_DTYPE_H_
