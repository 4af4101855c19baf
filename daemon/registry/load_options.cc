#include "daemon/registry/load_options.h"

#include "absl/strings/str_cat.h"
#include "core/limits.h"

namespace ferry {
namespace {

constexpr const char* kKnownKeys = "load_format, serve_as_peer";

absl::Status SetOne(const std::string& key, const std::string& value,
                    LoadOptions* o) {
  if (key == "load_format") {
    for (LoadFormat f : {LoadFormat::kAuto, LoadFormat::kDirectOnly,
                         LoadFormat::kFallbackOnly}) {
      if (value == LoadFormatName(f)) {
        o->load_format = f;
        return absl::OkStatus();
      }
    }
    return absl::InvalidArgumentError(absl::StrCat(
        "option load_format: value ", Quote(value),
        " is not one of auto, direct_only, fallback_only"));
  }
  if (key == "serve_as_peer") {
    if (value == "true" || value == "false") {
      o->serve_as_peer = value == "true";
      return absl::OkStatus();
    }
    return absl::InvalidArgumentError(
        absl::StrCat("option serve_as_peer: value ", Quote(value),
                     " is not true or false"));
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "option ", Quote(key), " is unknown; the keys are ", kKnownKeys));
}

}  // namespace

const char* LoadFormatName(LoadFormat f) {
  switch (f) {
    case LoadFormat::kDirectOnly:
      return "direct_only";
    case LoadFormat::kFallbackOnly:
      return "fallback_only";
    case LoadFormat::kAuto:
      break;
  }
  return "auto";
}

absl::StatusOr<LoadOptions> ApplyLoadOptions(
    const LoadOptions& current, const std::map<std::string, std::string>& set,
    const std::vector<std::string>& clear) {
  LoadOptions out = current;
  const LoadOptions defaults;
  for (const std::string& key : clear) {
    if (set.count(key)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "option ", Quote(key), " is both set and cleared"));
    }
    if (key == "load_format") {
      out.load_format = defaults.load_format;
    } else if (key == "serve_as_peer") {
      out.serve_as_peer = defaults.serve_as_peer;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "option ", Quote(key), " is unknown; the keys are ", kKnownKeys));
    }
  }
  for (const auto& [key, value] : set) {
    absl::Status s = SetOne(key, value, &out);
    if (!s.ok()) return s;
  }
  return out;
}

std::map<std::string, std::string> LoadOptionsToMap(const LoadOptions& o) {
  return {{"load_format", LoadFormatName(o.load_format)},
          {"serve_as_peer", o.serve_as_peer ? "true" : "false"}};
}

}  // namespace ferry
