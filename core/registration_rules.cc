#include "core/registration_rules.h"

#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status CheckRankInGroup(absl::string_view who,
                              absl::string_view rank_name, int64_t rank,
                              absl::string_view size_name, int64_t size) {
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", size_name, " ", size, " must be >= 1"));
  }
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", rank_name, " ", rank, " is outside [0, ", size, ")"));
  }
  return absl::OkStatus();
}

}  // namespace ferry
