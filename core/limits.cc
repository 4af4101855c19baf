#include "core/limits.h"

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace ferry {

std::string Quote(absl::string_view s) {
  const bool cut = s.size() > Limits::kMaxQuotedBytes;
  std::string out = absl::StrCat(
      "'", absl::CHexEscape(s.substr(0, Limits::kMaxQuotedBytes)), "'");
  if (cut) absl::StrAppend(&out, "...(", s.size(), " bytes)");
  return out;
}

}  // namespace ferry
