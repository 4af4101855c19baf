// LoadOptions: ferry's explicit load options for one instance
// (Lifecycle.UpdateConfig, docs/api.md "Load options"). They shape how the
// instance is planned, so they live with its membership in the Registry
// (a change moves the stream's epoch and the next delivery plans with
// them); they never move bytes by themselves.
//
// Keys and values:
//   load_format    auto | direct_only | fallback_only   (default auto)
//   serve_as_peer  true | false                          (default true)
//
// Pure; any thread.
#ifndef FERRY_DAEMON_REGISTRY_LOAD_OPTIONS_H_
#define FERRY_DAEMON_REGISTRY_LOAD_OPTIONS_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout_resolution.h"

namespace ferry {

struct LoadOptions {
  LoadFormat load_format = LoadFormat::kAuto;
  // Whether other instances may be filled from this one: as a relay within
  // a version, as the peer of a bootstrap or a reload.
  bool serve_as_peer = true;

  bool operator==(const LoadOptions& o) const {
    return load_format == o.load_format && serve_as_peer == o.serve_as_peer;
  }
};

// `current` with `set` applied and the keys of `clear` back at their
// defaults. INVALID_ARGUMENT naming the key (and the value) for an unknown
// key, a malformed value, or a key both set and cleared.
absl::StatusOr<LoadOptions> ApplyLoadOptions(
    const LoadOptions& current, const std::map<std::string, std::string>& set,
    const std::vector<std::string>& clear);

// Every key with its value, defaults included.
std::map<std::string, std::string> LoadOptionsToMap(const LoadOptions& o);

const char* LoadFormatName(LoadFormat f);  // "auto", "direct_only", ...

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_LOAD_OPTIONS_H_
