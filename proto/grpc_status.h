// The one place where absl::Status and grpc::Status convert into each other,
// for the daemon and the clients alike.
//
// The daemon's logic returns absl::Status (codes as docs/api.md, "Error
// model"); gRPC handlers return ToGrpcStatus(...) of it, and callers of an
// RPC turn its grpc::Status back with FromGrpcStatus (naming the call). The numeric codes of
// the two libraries are the same canonical codes, so the conversion keeps the
// code and the message and never invents either.
#ifndef FERRY_PROTO_GRPC_STATUS_H_
#define FERRY_PROTO_GRPC_STATUS_H_

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "grpcpp/support/server_callback.h"
#include "grpcpp/support/status.h"

namespace ferry {

inline grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()),
                      std::string(status.message()));
}

inline absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      status.error_message());
}

// The same, the message prefixed with what was called ("node b
// RunTransfer: ...", "Heartbeat of source policy rank 0: ...").
inline absl::Status FromGrpcStatus(const grpc::Status& status,
                                   absl::string_view what) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                      absl::StrCat(what, ": ", status.error_message()));
}

// A server-streaming call (gRPC's callback API) refused before it
// started: finishes with `status` at once, and deletes itself when done.
template <typename T>
class RefusedStream final : public grpc::ServerWriteReactor<T> {
 public:
  explicit RefusedStream(const grpc::Status& status) { this->Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace ferry

#endif  // FERRY_PROTO_GRPC_STATUS_H_
