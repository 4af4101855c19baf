// Whether a gRPC call may still do work: its client neither cancelled it
// nor let its deadline pass. Long handlers (registration, planning,
// ExplainPlan, CommitVersion, WaitForVersion) check it between steps and in
// long loops, and stop with DEADLINE_EXCEEDED instead of working for a
// caller that is gone (docs/api.md, "Limits").
#ifndef FERRY_DAEMON_API_CALL_DEADLINE_H_
#define FERRY_DAEMON_API_CALL_DEADLINE_H_

#include <chrono>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace ferry {

// True once the call was cancelled or its deadline passed. A null context
// (tests calling a handler directly) never expires.
inline bool CallExpired(const grpc::ServerContext* context) {
  if (context == nullptr) return false;
  return const_cast<grpc::ServerContext*>(context)->IsCancelled() ||
         std::chrono::system_clock::now() > context->deadline();
}

// The call's deadline (InfiniteFuture when it has none).
inline absl::Time CallDeadline(const grpc::ServerContext* context) {
  if (context == nullptr ||
      context->deadline() == std::chrono::system_clock::time_point::max()) {
    return absl::InfiniteFuture();
  }
  return absl::FromChrono(context->deadline());
}

// CallExpired as a callable, for code that must not see gRPC.
inline std::function<bool()> ExpiryOf(const grpc::ServerContext* context) {
  return [context] { return CallExpired(context); };
}

// DEADLINE_EXCEEDED "<what>: the call's deadline passed (or it was
// cancelled) before ...".
inline absl::Status Expired(absl::string_view what, absl::string_view when) {
  return absl::DeadlineExceededError(absl::StrCat(
      what, ": the call's deadline passed, or it was cancelled, ", when));
}

}  // namespace ferry

#endif  // FERRY_DAEMON_API_CALL_DEADLINE_H_
