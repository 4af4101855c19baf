// The one place where absl::Status and grpc::Status convert into each other.
//
// The daemon's logic returns absl::Status (codes as docs/api.md, "Error
// model"); gRPC handlers return ToGrpcStatus(...) of it. The numeric codes of
// the two libraries are the same canonical codes, so the conversion keeps the
// code and the message and never invents either.
#ifndef FERRY_DAEMON_STATUS_UTIL_H_
#define FERRY_DAEMON_STATUS_UTIL_H_

#include <string>

#include "absl/status/status.h"
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

}  // namespace ferry

#endif  // FERRY_DAEMON_STATUS_UTIL_H_
