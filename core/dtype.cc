#include "core/dtype.h"

#include <array>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

// Block geometry of the GGUF formats follows ggml's block structs:
// Q4_0 = fp16 scale + 16 bytes of nibbles per 32 elements, and so on; the
// K-quants use 256-element super-blocks.
constexpr std::array<DTypeInfo, 21> kDTypes = {{
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
}};

struct Alias {
  const char* name;
  DType dtype;
};
constexpr Alias kAliases[] = {
    {"float32", DType::kF32},      {"float", DType::kF32},
    {"float16", DType::kF16},      {"half", DType::kF16},
    {"bfloat16", DType::kBF16},    {"f8_e4m3fn", DType::kF8E4M3},
    {"float8_e4m3fn", DType::kF8E4M3}, {"float8_e5m2", DType::kF8E5M2},
    {"int8", DType::kI8},          {"uint8", DType::kU8},
    {"int32", DType::kI32},        {"int64", DType::kI64},
};

}  // namespace

const DTypeInfo& GetDTypeInfo(DType dtype) {
  return kDTypes[static_cast<size_t>(dtype)];
}

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (const DTypeInfo& info : kDTypes) {
    if (info.id != DType::kInvalid && lower == info.name) return info.id;
  }
  for (const Alias& alias : kAliases) {
    if (lower == alias.name) return alias.dtype;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown dtype '", name,
                   "' (known: f32 f16 bf16 f8_e4m3 f8_e5m2 i8 u8 i32 i64 bool "
                   "q4_0 q4_1 q5_0 q5_1 q8_0 q2_k q3_k q4_k q5_k q6_k)"));
}

}  // namespace ferry
