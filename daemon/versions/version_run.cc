// The run kinds' names, and a rank as a host copy knows it
// (version_run.h).
#include "daemon/versions/version_run.h"

namespace ferry {

const char* RunKindName(RunKind kind) {
  switch (kind) {
    case RunKind::kBootstrap:
      return "bootstrap";
    case RunKind::kReload:
      return "reload";
    case RunKind::kOffload:
      return "offload";
    case RunKind::kOnload:
      return "onload";
    case RunKind::kUnloadAdapter:
      return "unload_adapter";
    case RunKind::kVersion:
      break;
  }
  return "version";
}

HostCopy::Rank HostCopyRank(const Participant& p) {
  return HostCopy::Rank{p.id, p.Describe(), p.memory};
}

}  // namespace ferry
