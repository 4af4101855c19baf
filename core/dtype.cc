#include "core/dtype.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

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

absl::StatusOr<DType> ParseDType(absl::string_view name) {
  const std::string lower = absl::AsciiStrToLower(name);
  for (const DTypeInfo& info : kDTypeTable) {
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
