// ChildProcess: the one way tests start another program (ferryd, the demo
// trainer and engine, the soak's trainer rank) and stop, kill or restart it.
//
// Between fork and exec the child makes only async-signal-safe calls
// (everything it needs is prepared before fork), so it is safe to start
// from a process with gRPC and other threads running. Each child gets
// SIGKILL when the thread that started it dies (PR_SET_PDEATHSIG: start
// children from the test's main thread) and when its ChildProcess is
// destroyed; KillAllChildProcesses() kills every live one from a signal
// handler.
//
// Threading: a ChildProcess is used by one thread at a time.
// Catch2-free: failures come back as absl::Status
// (tests/client/process_harness.h REQUIREs on them).
#ifndef FERRY_TESTS_SUPPORT_CHILD_PROCESS_H_
#define FERRY_TESTS_SUPPORT_CHILD_PROCESS_H_

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ferry {
namespace testing {

struct ChildOptions {
  // The child's stderr, and its stdout unless `piped`, go to this file
  // (truncated); "": the child shares this process's stdout and stderr.
  std::string log;
  // The child's stdin and stdout are pipes to this process (WriteLine,
  // ReadLine).
  bool piped = false;
  // "NAME=value" entries added to this process's environment.
  std::vector<std::string> env;
};

class ChildProcess {
 public:
  static absl::StatusOr<std::unique_ptr<ChildProcess>> Start(
      const std::string& binary, std::vector<std::string> args,
      ChildOptions options = {});

  ChildProcess(const ChildProcess&) = delete;
  ChildProcess& operator=(const ChildProcess&) = delete;
  ~ChildProcess();  // Kill9

  pid_t pid() const { return pid_; }
  const std::string& log() const { return log_; }

  // Whether it still runs; reaps it once it exited.
  bool alive();
  // SIGKILL and reap (at once: a zombie looks alive to kill(pid, 0)).
  void Kill9();
  // The exit code within `timeout` (128 + N when signal N ended it), or -1
  // when it still runs then (it is left running).
  int Wait(absl::Duration timeout);
  // Sends `signal`, waits up to `timeout`, then SIGKILLs; the exit code.
  int Stop(int signal, absl::Duration timeout);
  // Closes stdin (EOF), then waits like Stop without a signal.
  int CloseStdinAndWait(absl::Duration timeout);

  // Once reaped: the exit code (128 + N: signal N), and waitpid's status.
  int exit_code() const;
  int wait_status() const { return status_; }

  // With ChildOptions::piped: one line to its stdin; one line from its
  // stdout (nullopt at EOF or after `timeout`).
  bool WriteLine(const std::string& line);
  std::optional<std::string> ReadLine(absl::Duration timeout);

 private:
  ChildProcess() = default;
  void Reaped(int status);

  pid_t pid_ = -1;
  std::string log_;
  int stdin_ = -1, stdout_ = -1;
  std::string buffer_;  // stdout read past the last line returned
  int status_ = 0;
  bool reaped_ = false;
};

// The path of an executable of this workspace in the runfiles ("" when it
// is not there): under $TEST_SRCDIR or $RUNFILES_DIR (a test, `bazel
// run`), else next to this binary (bazel-bin/.../NAME.runfiles).
std::string Runfile(const std::string& path);

// SIGKILLs every child started by ChildProcess and not yet reaped.
// Async-signal-safe (for a fatal-signal handler).
void KillAllChildProcesses();

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_SUPPORT_CHILD_PROCESS_H_
