#include "core/models/models_dir.h"

#include <cstdlib>
#include <filesystem>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

// The BUILD file lists this header as data of //core/models, so every
// runfiles tree that uses the library holds a link to it.
constexpr char kAnchor[] = "core/models/models_dir.h";

bool IsDir(const fs::path& p) {
  std::error_code ec;
  return fs::is_directory(p, ec);
}

// Walks from `start` up to the root, looking for shared/models.
bool FindUpward(const fs::path& start, std::string* found) {
  std::error_code ec;
  fs::path dir = fs::absolute(start, ec);
  if (ec) return false;
  while (true) {
    const fs::path candidate = dir / "shared" / "models";
    if (IsDir(candidate)) {
      *found = fs::weakly_canonical(candidate, ec).string();
      if (ec) *found = candidate.string();
      return true;
    }
    if (!dir.has_parent_path() || dir.parent_path() == dir) return false;
    dir = dir.parent_path();
  }
}

std::vector<fs::path> RunfilesDirs() {
  std::vector<fs::path> dirs;
  for (const char* var : {"RUNFILES_DIR", "TEST_SRCDIR"}) {
    if (const char* v = std::getenv(var); v != nullptr && *v != '\0') {
      dirs.emplace_back(v);
    }
  }
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) dirs.push_back(fs::path(exe.string() + ".runfiles"));
  return dirs;
}

}  // namespace

absl::StatusOr<std::string> FindModelsDir() {
  if (const char* env = std::getenv("FERRY_MODELS_DIR");
      env != nullptr && *env != '\0') {
    if (IsDir(env)) return std::string(env);
    return absl::NotFoundError(
        absl::StrCat("FERRY_MODELS_DIR=", env, " is not a directory"));
  }
  std::vector<fs::path> starts;
  std::error_code ec;
  starts.push_back(fs::current_path(ec));
  const char* ws = std::getenv("TEST_WORKSPACE");
  const std::string workspace = (ws != nullptr && *ws != '\0') ? ws : "ferry";
  for (const fs::path& runfiles : RunfilesDirs()) {
    if (!IsDir(runfiles)) continue;
    starts.push_back(runfiles);
    const fs::path anchor = runfiles / workspace / kAnchor;
    const fs::path real = fs::canonical(anchor, ec);  // follows the link
    if (!ec) starts.push_back(real.parent_path());
  }
  std::string found;
  std::vector<std::string> looked;
  for (const fs::path& start : starts) {
    if (start.empty()) continue;
    if (FindUpward(start, &found)) return found;
    looked.push_back(start.string());
  }
  return absl::NotFoundError(absl::StrCat(
      "no shared/models above ", absl::StrJoin(looked, ", "),
      "; set FERRY_MODELS_DIR to the directory of the model JSON files"));
}

}  // namespace ferry
