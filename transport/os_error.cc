#include "transport/os_error.h"

#include <cerrno>

#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status ErrnoStatus(absl::string_view call, int err) {
  absl::StatusCode code;
  switch (err) {
    // The peer is gone or unreachable: the daemon retries or reconnects.
    // absl maps EPIPE to FAILED_PRECONDITION and ENOTCONN to
    // FAILED_PRECONDITION too, which would hide that.
    case EPIPE:
    case ECONNRESET:
    case ECONNREFUSED:
    case ECONNABORTED:
    case ENOTCONN:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case EHOSTDOWN:
      code = absl::StatusCode::kUnavailable;
      break;
    default:
      code = absl::ErrnoToStatusCode(err);
  }
  // absl::ErrnoToStatus formats "<message>: <strerror>" thread-safely.
  const absl::Status described = absl::ErrnoToStatus(err, call);
  return absl::Status(code,
                      absl::StrCat(described.message(), " (errno ", err, ")"));
}

}  // namespace ferry
