#include "client/names.h"

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status ValidateName(absl::string_view field, absl::string_view value) {
  if (value.empty() || value.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " '", value, "' must be 1 to 128 characters of [A-Za-z0-9._-]"));
  }
  for (char c : value) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' &&
        c != '_' && c != '-') {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " '", value, "' has character '",
                       std::string(1, c), "'; allowed: [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
