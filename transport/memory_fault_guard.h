// MemoryFaultGuard: copies from and into client memory that survive the
// client shrinking that memory under them.
//
// ferryd maps its clients' shared memory (POSIX shm, memfds) and copies
// between the mappings. A client that truncates a named shm object after
// registering it (ftruncate; POSIX shm cannot be sealed), or a region whose
// backing store cannot be allocated (a sparse file on a full /dev/shm),
// makes the next access to the lost pages raise SIGBUS. Without a guard that
// signal kills the daemon, and with it every other client's versions.
//
// RunGuarded runs a copy with a per-thread recovery point: a SIGBUS raised
// by that thread inside it jumps back out, and RunGuarded returns
// FAILED_PRECONDITION carrying the faulting address (FaultAddress), which
// the caller turns into "participant P, region R shrank". A SIGBUS anywhere
// else (a bug of ferryd's own) goes to the handler that was installed
// before (glog's failure handler in ferryd, which prints the stack) or the
// default action, as if the guard were not there.
//
// REQUIRES of `fn`: it only reads and writes memory (memcpy and the loops
// around it): it takes no lock and owns nothing that must be released,
// since a fault abandons it half way without unwinding (a small vector it
// allocated leaks, once per fault).
//
// Threading: any thread, any number at once; the recovery point is
// thread-local. InstallMemoryFaultHandler is idempotent and thread-safe;
// RunGuarded calls it, but ferryd calls it once at start, after glog
// installed its own handler, so that the chain order is fixed.
#ifndef FERRY_TRANSPORT_MEMORY_FAULT_GUARD_H_
#define FERRY_TRANSPORT_MEMORY_FAULT_GUARD_H_

#include <cstdint>
#include <optional>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"

namespace ferry {

// Installs the SIGBUS handler (once; later calls do nothing).
void InstallMemoryFaultHandler();

// Runs fn(); OK, or FAILED_PRECONDITION("memory at 0x... is no longer
// backed (SIGBUS) ...") with the address attached when fn faulted.
absl::Status RunGuarded(absl::FunctionRef<void()> fn);

// The faulting address of a status RunGuarded returned, if it has one.
std::optional<uintptr_t> FaultAddress(const absl::Status& status);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_MEMORY_FAULT_GUARD_H_
