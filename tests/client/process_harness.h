// Test harness for tests that drive real ferry processes (ferryd, the demo
// trainer and engine): finding binaries in the runfiles, starting a child
// with its output in a log file (tests/support/child_process.h), waiting
// for a condition (tests/support/eventually.h), reading logs.
// Header-only and Catch2-aware (REQUIREs on harness failures).
#ifndef FERRY_TESTS_CLIENT_PROCESS_HARNESS_H_
#define FERRY_TESTS_CLIENT_PROCESS_HARNESS_H_

#include <catch2/catch.hpp>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "tests/support/child_process.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {

// A child process (tests/support/child_process.h): SIGKILLed and reaped on
// destruction if still running.
using Process = ChildProcess;

// Starts `binary` with its stdout and stderr in `options.log` (see
// ChildOptions), or fails the test. Call from the test's thread.
inline std::unique_ptr<Process> StartProcess(const std::string& binary,
                                             std::vector<std::string> args,
                                             ChildOptions options) {
  absl::StatusOr<std::unique_ptr<Process>> p =
      ChildProcess::Start(binary, std::move(args), std::move(options));
  INFO("starting " << binary << ": " << p.status().ToString());
  REQUIRE(p.ok());
  return *std::move(p);
}

inline std::unique_ptr<Process> StartProcess(const std::string& binary,
                                             std::vector<std::string> args,
                                             const std::string& log) {
  ChildOptions options;
  options.log = log;
  return StartProcess(binary, std::move(args), std::move(options));
}

// The one way tests start the real ferryd (//daemon:ferryd in the test's
// data): `args` are its flags; its output goes to `log` ("": the test's).
inline std::unique_ptr<Process> StartFerryd(std::vector<std::string> args,
                                            const std::string& log) {
  return StartProcess(Runfile("daemon/ferryd"), std::move(args), log);
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
