#include "tests/support/child_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

extern char** environ;

namespace ferry {
namespace testing {
namespace {

// Live children, for KillAllChildProcesses: lock-free, so a signal
// handler may read it.
constexpr int kMaxChildren = 64;
std::atomic<pid_t> g_children[kMaxChildren];

void Track(pid_t pid) {
  for (auto& slot : g_children) {
    pid_t empty = 0;
    if (slot.compare_exchange_strong(empty, pid)) return;
  }
}

void Untrack(pid_t pid) {
  for (auto& slot : g_children) {
    pid_t p = pid;
    if (slot.compare_exchange_strong(p, 0)) return;
  }
}

absl::Status Errno(const std::string& what) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(errno)));
}

}  // namespace

void KillAllChildProcesses() {
  for (auto& slot : g_children) {
    const pid_t pid = slot.load();
    if (pid > 0) kill(pid, SIGKILL);
  }
}

absl::StatusOr<std::unique_ptr<ChildProcess>> ChildProcess::Start(
    const std::string& binary, std::vector<std::string> args,
    ChildOptions options) {
  if (binary.empty() || access(binary.c_str(), X_OK) != 0) {
    return absl::NotFoundError(absl::StrCat(
        "no executable '", binary, "' (is it a data dependency?)"));
  }
  // Everything the child needs, made before fork: after it, the child may
  // not allocate (another thread may hold the allocator's lock).
  int in[2] = {-1, -1}, out[2] = {-1, -1};
  if (options.piped) {
    if (pipe2(in, O_CLOEXEC) != 0) return Errno("pipe2");
    if (pipe2(out, O_CLOEXEC) != 0) {
      close(in[0]);
      close(in[1]);
      return Errno("pipe2");
    }
  }
  int log_fd = -1;
  if (!options.log.empty()) {
    log_fd = open(options.log.c_str(),
                  O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (log_fd < 0) {
      for (int fd : {in[0], in[1], out[0], out[1]}) {
        if (fd >= 0) close(fd);
      }
      return Errno(absl::StrCat("open ", options.log));
    }
  }
  std::string bin = binary;
  std::vector<char*> argv;
  argv.push_back(bin.data());
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::vector<char*> envp;
  for (char** e = environ; *e != nullptr; ++e) envp.push_back(*e);
  for (std::string& e : options.env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid == 0) {  // only async-signal-safe calls until execve
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(126);  // the parent died before prctl
    if (options.piped) {
      dup2(in[0], STDIN_FILENO);
      dup2(out[1], STDOUT_FILENO);
    } else if (log_fd >= 0) {
      dup2(log_fd, STDOUT_FILENO);
    }
    if (log_fd >= 0) dup2(log_fd, STDERR_FILENO);
    execve(argv[0], argv.data(), envp.data());
    _exit(127);
  }
  const int fork_errno = errno;
  if (log_fd >= 0) close(log_fd);
  if (options.piped) {
    close(in[0]);
    close(out[1]);
  }
  if (pid < 0) {
    if (options.piped) {
      close(in[1]);
      close(out[0]);
    }
    errno = fork_errno;
    return Errno("fork");
  }
  Track(pid);
  std::unique_ptr<ChildProcess> c(new ChildProcess);
  c->pid_ = pid;
  c->log_ = options.log;
  if (options.piped) {
    c->stdin_ = in[1];
    c->stdout_ = out[0];
  }
  return c;
}

ChildProcess::~ChildProcess() {
  Kill9();
  if (stdin_ >= 0) close(stdin_);
  if (stdout_ >= 0) close(stdout_);
}

void ChildProcess::Reaped(int status) {
  status_ = status;
  reaped_ = true;
  Untrack(pid_);
}

bool ChildProcess::alive() {
  if (reaped_) return false;
  int status = 0;
  if (waitpid(pid_, &status, WNOHANG) == pid_) Reaped(status);
  return !reaped_;
}

void ChildProcess::Kill9() {
  if (reaped_) return;
  kill(pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  Reaped(status);
}

int ChildProcess::Wait(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (alive() && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(20));  // polling an exit, not a sync
  }
  return alive() ? -1 : exit_code();
}

int ChildProcess::Stop(int signal, absl::Duration timeout) {
  if (!reaped_) kill(pid_, signal);
  if (Wait(timeout) < 0) Kill9();
  return exit_code();
}

int ChildProcess::CloseStdinAndWait(absl::Duration timeout) {
  if (stdin_ >= 0) close(stdin_);
  stdin_ = -1;
  if (Wait(timeout) < 0) Kill9();
  return exit_code();
}

int ChildProcess::exit_code() const {
  return WIFEXITED(status_) ? WEXITSTATUS(status_) : 128 + WTERMSIG(status_);
}

bool ChildProcess::WriteLine(const std::string& line) {
  const std::string s = line + "\n";
  return stdin_ >= 0 &&
         write(stdin_, s.data(), s.size()) == static_cast<ssize_t>(s.size());
}

std::optional<std::string> ChildProcess::ReadLine(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (true) {
    const size_t nl = buffer_.find('\n');
    if (nl != std::string::npos) {
      std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      return line;
    }
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (stdout_ < 0 || left <= 0) return std::nullopt;
    pollfd p{stdout_, POLLIN, 0};
    const int r = poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000)));
    if (r < 0 && errno != EINTR) return std::nullopt;
    if (r <= 0) continue;
    char chunk[4096];
    const ssize_t n = read(stdout_, chunk, sizeof(chunk));
    if (n <= 0) return std::nullopt;  // EOF: the child is gone
    buffer_.append(chunk, static_cast<size_t>(n));
  }
}

std::string Runfile(const std::string& path) {
  std::vector<std::string> roots;
  for (const char* var : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    if (const char* dir = std::getenv(var)) roots.push_back(dir);
  }
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    exe[n] = '\0';
    roots.push_back(std::string(exe) + ".runfiles");
  }
  for (const std::string& root : roots) {
    const std::string full = root + "/ferry/" + path;
    if (access(full.c_str(), X_OK) == 0) return full;
  }
  return "";
}

}  // namespace testing
}  // namespace ferry
