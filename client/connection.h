// Connection: the gRPC channel from a client process to a ferryd.
//
// Participants (trainer and engine ranks) talk to the ferryd on their own
// node over its unix socket; operators (ferryctl) may use any daemon's TCP
// port. A Connection is a cheap value: it holds a reference-counted gRPC
// channel and the stubs of the services a client calls, so a SourceClient,
// a DestinationClient and ferryctl can each hold a copy of the same one.
//
// Deadlines: nothing in the client library blocks without one. Every unary
// call goes through NewContext(timeout), which sets the gRPC deadline; the
// only call without a deadline is the Subscribe stream, which lasts as long
// as a registration and is ended by cancelling its context.
//
// Threading: gRPC channels and stubs are thread-safe; so is a Connection.
#ifndef FERRY_CLIENT_CONNECTION_H_
#define FERRY_CLIENT_CONNECTION_H_

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/socket_path.h"  // DefaultSocketPath, re-exported
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "proto/ferry/v1/lifecycle.grpc.pb.h"
#include "proto/ferry/v1/registration.grpc.pb.h"
#include "proto/ferry/v1/version.grpc.pb.h"
#include "proto/grpc_status.h"

namespace ferry {

// A gRPC target from what a user typed: "" -> "unix:" + DefaultSocketPath();
// "unix:PATH" and "host:port" unchanged; a path starting with '/' or '.'
// -> "unix:PATH".
std::string NormalizeDaemonAddress(absl::string_view address);

// FromGrpcStatus(status, what): proto/grpc_status.h, re-exported here for
// the clients (the daemon's message prefixed with what the client was
// doing, "RegisterSource: ...").

struct ConnectionOptions {
  // See NormalizeDaemonAddress.
  std::string address;
  // Largest message the client accepts. A large model's ExplainPlan runs to
  // tens of MB (docs/api.md, "Message size"); gRPC's default is 4 MiB.
  int max_receive_bytes = 256 << 20;
  // Default deadline of unary calls made through NewContext().
  absl::Duration rpc_timeout = absl::Seconds(30);
  // A daemon reached over TCP (host:port) serves only mutual TLS: this
  // client's certificate and key, and the cluster CA (PEM files). Unused
  // for a unix socket, where the daemon checks the caller's uid instead.
  std::string tls_cert;
  std::string tls_key;
  std::string tls_ca;
};

class Connection {
 public:
  // Creates the channel; does not wait for the daemon (see WaitForReady).
  // INVALID_ARGUMENT for a malformed option.
  static absl::StatusOr<Connection> Open(const ConnectionOptions& options);

  // Open, then WaitForReady(ready_timeout): what a process that cannot do
  // anything without its daemon wants.
  static absl::StatusOr<Connection> Connect(const ConnectionOptions& options,
                                            absl::Duration ready_timeout);

  // Waits until the channel is connected, at most `timeout`. UNAVAILABLE,
  // naming the address, when the daemon is not there by then.
  absl::Status WaitForReady(absl::Duration timeout) const;

  // A context whose deadline is now + timeout (the options' rpc_timeout
  // when `timeout` is zero).
  std::unique_ptr<grpc::ClientContext> NewContext(
      absl::Duration timeout = absl::ZeroDuration()) const;

  const std::string& address() const { return address_; }
  absl::Duration rpc_timeout() const { return rpc_timeout_; }

  v1::Registry::Stub& registry() const { return *registry_; }
  v1::Versions::Stub& versions() const { return *versions_; }
  v1::Inspection::Stub& inspection() const { return *inspection_; }
  v1::Lifecycle::Stub& lifecycle() const { return *lifecycle_; }
  // The channel itself, for services outside ferry.v1 (the standard gRPC
  // health service: `ferryctl probe`).
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  Connection() = default;

  std::string address_;
  absl::Duration rpc_timeout_;
  std::shared_ptr<grpc::Channel> channel_;
  // Stubs are shared between copies; gRPC stubs are thread-safe.
  std::shared_ptr<v1::Registry::Stub> registry_;
  std::shared_ptr<v1::Versions::Stub> versions_;
  std::shared_ptr<v1::Inspection::Stub> inspection_;
  std::shared_ptr<v1::Lifecycle::Stub> lifecycle_;
};

}  // namespace ferry

#endif  // FERRY_CLIENT_CONNECTION_H_
