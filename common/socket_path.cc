#include "common/socket_path.h"

#include <unistd.h>

#include <cstdlib>

#include "absl/strings/str_cat.h"

namespace ferry {

std::string DefaultSocketPath() {
  const char* explicit_path = std::getenv("FERRY_SOCKET");
  if (explicit_path != nullptr && explicit_path[0] != '\0') {
    return explicit_path;
  }
  const char* runtime_dir = std::getenv("XDG_RUNTIME_DIR");
  if (runtime_dir != nullptr && runtime_dir[0] != '\0') {
    return absl::StrCat(runtime_dir, "/ferry/ferryd.sock");
  }
  return absl::StrCat("/tmp/ferry-", ::getuid(), "/ferryd.sock");
}

}  // namespace ferry
