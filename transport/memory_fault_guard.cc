#include "transport/memory_fault_guard.h"

#include <setjmp.h>
#include <signal.h>

#include <cstring>
#include <mutex>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

constexpr char kFaultAddressPayload[] = "type.ferry/memory_fault_address";

// This thread's recovery point while it is inside RunGuarded.
struct RecoveryPoint {
  sigjmp_buf env;
  uintptr_t address = 0;
};
// Initial-exec TLS: reading it in the signal handler allocates nothing.
thread_local RecoveryPoint* t_recovery
    __attribute__((tls_model("initial-exec"))) = nullptr;

struct sigaction g_previous;  // written once, before the handler is live

void ChainToPrevious(int sig, siginfo_t* info, void* context) {
  if ((g_previous.sa_flags & SA_SIGINFO) != 0 &&
      g_previous.sa_sigaction != nullptr) {
    g_previous.sa_sigaction(sig, info, context);
    return;
  }
  if (g_previous.sa_handler != SIG_DFL && g_previous.sa_handler != SIG_IGN &&
      (g_previous.sa_flags & SA_SIGINFO) == 0) {
    g_previous.sa_handler(sig);
    return;
  }
  // Default action: returning re-executes the faulting access, which then
  // kills the process with SIGBUS as if no handler had been installed.
  ::signal(sig, SIG_DFL);
}

void OnSigbus(int sig, siginfo_t* info, void* context) {
  RecoveryPoint* recovery = t_recovery;
  if (recovery != nullptr) {
    recovery->address = reinterpret_cast<uintptr_t>(info->si_addr);
    siglongjmp(recovery->env, 1);
  }
  ChainToPrevious(sig, info, context);
}

}  // namespace

void InstallMemoryFaultHandler() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    ::sigaction(SIGBUS, &action, &g_previous);
  });
}

absl::Status RunGuarded(absl::FunctionRef<void()> fn) {
  InstallMemoryFaultHandler();
  RecoveryPoint recovery;
  // sigsetjmp(.., 1) saves the signal mask, so the jump out of the handler
  // unblocks SIGBUS again for this thread.
  if (sigsetjmp(recovery.env, 1) == 0) {
    t_recovery = &recovery;
    fn();
    t_recovery = nullptr;
    return absl::OkStatus();
  }
  t_recovery = nullptr;
  absl::Status status = absl::FailedPreconditionError(absl::StrCat(
      "memory at 0x", absl::Hex(recovery.address),
      " is no longer backed (SIGBUS): its shared memory was shrunk or "
      "could not be allocated"));
  status.SetPayload(kFaultAddressPayload,
                    absl::Cord(absl::StrCat(recovery.address)));
  return status;
}

std::optional<uintptr_t> FaultAddress(const absl::Status& status) {
  auto payload = status.GetPayload(kFaultAddressPayload);
  if (!payload.has_value()) return std::nullopt;
  uint64_t address = 0;
  if (!absl::SimpleAtoi(std::string(*payload), &address)) return std::nullopt;
  return static_cast<uintptr_t>(address);
}

}  // namespace ferry
