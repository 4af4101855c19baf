// Runs ipc_exporter (a second process that owns a CUDA allocation) and
// reads back its IPC handle: CUDA IPC handles cannot be opened by the
// process that made them, so tests and benchmarks need a real second
// process. The exporter lives until this object is destroyed (its stdin is
// closed then).
#ifndef FERRY_TESTS_GPU_EXPORTER_PROCESS_H_
#define FERRY_TESTS_GPU_EXPORTER_PROCESS_H_

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace ferry {
namespace gpu_testing {

class ExporterProcess {
 public:
  // Beside the running binary (bazel-bin/tests/gpu/ or bench/gpu's runfiles)
  // or $FERRY_IPC_EXPORTER.
  static std::string DefaultPath() {
    if (const char* p = std::getenv("FERRY_IPC_EXPORTER")) return p;
    char self[PATH_MAX] = {0};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
    std::string dir = n > 0 ? std::string(self, n) : std::string(".");
    dir = dir.substr(0, dir.rfind('/'));
    for (const std::string& candidate :
         {dir + "/ipc_exporter", dir + "/../../tests/gpu/ipc_exporter"}) {
      if (access(candidate.c_str(), X_OK) == 0) return candidate;
    }
    return dir + "/ipc_exporter";
  }

  ExporterProcess() = default;
  ExporterProcess(const ExporterProcess&) = delete;
  ExporterProcess& operator=(const ExporterProcess&) = delete;
  ~ExporterProcess() {
    if (to_child_ >= 0) close(to_child_);
    if (from_child_ != nullptr) std::fclose(from_child_);
    if (pid_ > 0) {
      int status = 0;
      waitpid(pid_, &status, 0);
    }
  }

  // Starts the exporter with an allocation of `bytes`; returns the handle.
  absl::StatusOr<std::string> Start(size_t bytes) {
    const std::string path = DefaultPath();
    int in[2], out[2];
    if (pipe(in) != 0 || pipe(out) != 0) return absl::InternalError("pipe");
    pid_ = fork();
    if (pid_ < 0) return absl::InternalError("fork");
    if (pid_ == 0) {
      dup2(in[0], 0);
      dup2(out[1], 1);
      close(in[1]);
      close(out[0]);
      const std::string arg = std::to_string(bytes);
      execl(path.c_str(), path.c_str(), arg.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(in[0]);
    close(out[1]);
    to_child_ = in[1];
    from_child_ = fdopen(out[0], "r");
    char line[512] = {0};
    if (std::fgets(line, sizeof(line), from_child_) == nullptr) {
      return absl::UnavailableError(absl::StrCat("no handle from ", path));
    }
    std::string hex(line);
    while (!hex.empty() && (hex.back() == '\n' || hex.back() == '\r')) hex.pop_back();
    if (hex.rfind("ERROR", 0) == 0 || hex.size() % 2 != 0) {
      return absl::InternalError(absl::StrCat(path, ": ", hex));
    }
    std::string handle;
    for (size_t i = 0; i < hex.size(); i += 2) {
      handle.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
    return handle;
  }

  // The byte the exporter wrote at offset i.
  static uint8_t PatternByte(size_t i) { return static_cast<uint8_t>(i * 7 + 3); }

 private:
  pid_t pid_ = -1;
  int to_child_ = -1;
  FILE* from_child_ = nullptr;
};

}  // namespace gpu_testing
}  // namespace ferry

#endif  // FERRY_TESTS_GPU_EXPORTER_PROCESS_H_
