// The one place where errno becomes absl::Status for the host transports.
//
// Every failing system call on the data plane (shm_open, mmap, socket,
// connect, send, recv, poll, ...) is reported through ErrnoStatus, so that
// every error names the call and what it acted on ("connect(10.0.0.2:7000):
// Connection refused") and the status code follows one mapping.
#ifndef FERRY_TRANSPORT_OS_ERROR_H_
#define FERRY_TRANSPORT_OS_ERROR_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ferry {

// `call` names the call and its object, e.g. "mmap(/ferry-x, 4096 bytes)".
// A peer that went away (EPIPE, ECONNRESET, ECONNREFUSED, ...) maps to
// UNAVAILABLE, so callers see one code for "the other side is gone"; the
// rest follow absl::ErrnoToStatusCode.
absl::Status ErrnoStatus(absl::string_view call, int err);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_OS_ERROR_H_
