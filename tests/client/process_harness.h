// Test harness for tests that drive real ferry processes (ferryd, the demo
// trainer and engine): finding binaries in the runfiles, running a child
// with its output in a log file, waiting for a condition, reading logs.
// Header-only and Catch2-aware (REQUIREs on harness failures).
#ifndef FERRY_TESTS_CLIENT_PROCESS_HARNESS_H_
#define FERRY_TESTS_CLIENT_PROCESS_HARNESS_H_

#include <catch2/catch.hpp>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ferry {
namespace testing {

// The path of an executable data dependency, "" when it is not there.
inline std::string Runfile(const std::string& path) {
  for (const char* var : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* dir = std::getenv(var);
    if (dir == nullptr) continue;
    const std::string full = absl::StrCat(dir, "/ferry/", path);
    if (access(full.c_str(), X_OK) == 0) return full;
  }
  return "";
}

// A child process with stdout and stderr in `log`; SIGKILLed and reaped on
// destruction if still running.
class Process {
 public:
  Process(const std::string& binary, std::vector<std::string> args,
          const std::string& log) {
    REQUIRE_FALSE(binary.empty());
    pid_ = fork();
    REQUIRE(pid_ >= 0);
    if (pid_ == 0) {
      FILE* out = std::freopen(log.c_str(), "w", stdout);
      if (out != nullptr) dup2(fileno(stdout), STDERR_FILENO);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(binary.c_str()));
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
  }
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;
  ~Process() {
    if (pid_ > 0) Kill9();
  }
  void Kill9() {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // The exit code, or -1 if it did not exit within `timeout`.
  int Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      int status = 0;
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      absl::SleepFor(absl::Milliseconds(20));  // polling an exit, not a sync
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
};

// Polls `done` every 20 ms until it is true or `timeout` passes.
inline bool Eventually(const std::function<bool()>& done,
                       absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

// Whether some line of the log at `path` contains `text`.
inline bool LogHas(const std::string& path, const std::string& text) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.find(text) != std::string::npos) return true;
  }
  return false;
}

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_CLIENT_PROCESS_HARNESS_H_
