// CheckFp8Declarations (core/layout_resolution.h): the rules an engine
// rank's FP8 declarations follow on their own (core/fp8_targets.h).
#include <cstdint>
#include <string>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/fp8_targets.h"
#include "core/layout_resolution.h"

namespace ferry {
namespace {

// Larger blocks are no FP8 format anyone serves, and a block size near
// 2^63 would overflow the arithmetic that places blocks.
constexpr int64_t kMaxFp8Block = int64_t{1} << 20;

// A dtype's name, also for a value no dtype has (a table not validated
// yet: resolution checks declarations before each live tensor).
std::string NameOf(DType dtype) {
  if (IsValidDType(dtype)) return DTypeName(dtype);
  return absl::StrCat("no valid dtype (", static_cast<int>(dtype), ")");
}

}  // namespace

absl::Status CheckFp8Declarations(absl::Span<const EngineParam> params,
                                  absl::string_view who) {
  absl::flat_hash_map<absl::string_view, size_t> by_name;
  bool any = false;
  for (size_t i = 0; i < params.size(); ++i) {
    by_name.emplace(params[i].name, i);
    any = any || params[i].fp8.declared();
  }
  if (!any) return absl::OkStatus();
  // Scale parameter -> the weight that declared it first.
  absl::flat_hash_map<absl::string_view, size_t> scale_of;
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& p = params[i];
    if (!p.fp8.declared()) continue;
    const Fp8Declaration& f = p.fp8;
    auto error = [&](const std::string& what) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": engine parameter ", p.name, " (FP8, scales in ", f.scale,
          "): ", what));
    };
    if (!p.alias_of.empty()) {
      return error(absl::StrCat("an alias (of ", p.alias_of,
                                ") cannot be declared FP8; declare ",
                                p.alias_of));
    }
    if (!IsFp8Format(p.dtype)) {
      return error(absl::StrCat("its dtype is ", NameOf(p.dtype),
                                "; a weight quantized in flight is f8_e4m3 "
                                "or f8_e5m2"));
    }
    if (p.local_shape.size() < 2) {
      return error(absl::StrCat("local shape ", DimsToString(p.local_shape),
                                " has fewer than the two dims FP8 blocks "
                                "span"));
    }
    if (f.block_rows < 1 || f.block_rows > kMaxFp8Block ||
        f.block_cols < 1 || f.block_cols > kMaxFp8Block) {
      return error(absl::StrCat("block ", f.block_rows, "x", f.block_cols,
                                " is not in [1, ", kMaxFp8Block, "] each way"));
    }
    auto it = by_name.find(f.scale);
    if (it == by_name.end() || it->second == i) {
      return error(absl::StrCat("its scale tensor ", f.scale,
                                it == by_name.end()
                                    ? " is no engine parameter of the rank"
                                    : " is the weight itself"));
    }
    const EngineParam& s = params[it->second];
    if (s.fp8.declared() || !s.alias_of.empty()) {
      return error(absl::StrCat("its scale tensor ", s.name, " is ",
                                s.fp8.declared() ? "declared FP8 itself"
                                                 : "an alias"));
    }
    auto [claimed, fresh] = scale_of.emplace(s.name, i);
    if (!fresh) {
      return error(absl::StrCat("its scale tensor ", s.name,
                                " holds the scales of ",
                                params[claimed->second].name, " already"));
    }
    if (s.dtype != DType::kF32) {
      return error(absl::StrCat("its scale tensor ", s.name, " is ",
                                NameOf(s.dtype),
                                "; block scales are f32"));
    }
    const Dims want = Fp8ScaleShape(p.local_shape, f.block_rows, f.block_cols);
    if (s.local_shape != want) {
      return error(absl::StrCat(
          "its scale tensor ", s.name, " has shape ",
          DimsToString(s.local_shape), "; ", f.block_rows, "x", f.block_cols,
          " blocks of ", DimsToString(p.local_shape), " need ",
          DimsToString(want)));
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
