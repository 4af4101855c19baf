#include "client/connection.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/channel_args.h"

namespace ferry {

std::string NormalizeDaemonAddress(absl::string_view address) {
  if (address.empty()) return absl::StrCat("unix:", DefaultSocketPath());
  if (absl::StartsWith(address, "/") || absl::StartsWith(address, ".")) {
    return absl::StrCat("unix:", address);
  }
  return std::string(address);
}

namespace {

absl::StatusOr<std::string> ReadPemFile(const std::string& path,
                                        const char* what) {
  std::ifstream in(path);
  std::stringstream text;
  if (in) text << in.rdbuf();
  if (!in || text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", path, " cannot be read as a PEM file"));
  }
  return text.str();
}

// Mutual TLS for a daemon at host:port (docs/api.md, "Authentication").
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TcpCredentials(
    const ConnectionOptions& options, const std::string& address) {
  if (options.tls_cert.empty() || options.tls_key.empty() ||
      options.tls_ca.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ferryd at ", address, " is reached over TCP, which it serves only "
        "with mutual TLS: give a client certificate, its key and the "
        "cluster CA (ferryctl --tls_cert, --tls_key, --tls_ca), or use its "
        "unix socket"));
  }
  grpc::SslCredentialsOptions ssl;
  absl::StatusOr<std::string> cert = ReadPemFile(options.tls_cert, "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> key = ReadPemFile(options.tls_key, "tls_key");
  if (!key.ok()) return key.status();
  absl::StatusOr<std::string> ca = ReadPemFile(options.tls_ca, "tls_ca");
  if (!ca.ok()) return ca.status();
  ssl.pem_cert_chain = *cert;
  ssl.pem_private_key = *key;
  ssl.pem_root_certs = *ca;
  return grpc::SslCredentials(ssl);
}

}  // namespace

absl::StatusOr<Connection> Connection::Open(const ConnectionOptions& options) {
  if (options.max_receive_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_receive_bytes must be > 0, got ", options.max_receive_bytes));
  }
  if (options.rpc_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("rpc_timeout must be > 0");
  }
  Connection c;
  c.address_ = NormalizeDaemonAddress(options.address);
  c.rpc_timeout_ = options.rpc_timeout;
  // Reconnects within about a second of a daemon's restart, so clients
  // re-register promptly (common/channel_args.h).
  grpc::ChannelArguments args = QuickReconnectArgs();
  args.SetMaxReceiveMessageSize(options.max_receive_bytes);
  // Registrations of large models are big too (docs/api.md).
  args.SetMaxSendMessageSize(options.max_receive_bytes);
  std::shared_ptr<grpc::ChannelCredentials> credentials =
      grpc::InsecureChannelCredentials();
  if (!absl::StartsWith(c.address_, "unix:")) {
    absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> tls =
        TcpCredentials(options, c.address_);
    if (!tls.ok()) return tls.status();
    credentials = *tls;
  }
  c.channel_ = grpc::CreateCustomChannel(c.address_, credentials, args);
  c.registry_ = v1::Registry::NewStub(c.channel_);
  c.versions_ = v1::Versions::NewStub(c.channel_);
  c.inspection_ = v1::Inspection::NewStub(c.channel_);
  c.lifecycle_ = v1::Lifecycle::NewStub(c.channel_);
  return c;
}

absl::StatusOr<Connection> Connection::Connect(const ConnectionOptions& options,
                                               absl::Duration ready_timeout) {
  absl::StatusOr<Connection> c = Open(options);
  if (!c.ok()) return c;
  if (absl::Status s = c->WaitForReady(ready_timeout); !s.ok()) return s;
  return c;
}

absl::Status Connection::WaitForReady(absl::Duration timeout) const {
  const auto deadline = absl::ToChronoTime(absl::Now() + timeout);
  if (channel_->WaitForConnected(deadline)) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat(
      "no ferryd answers at ", address_, " within ",
      absl::FormatDuration(timeout),
      " (is it running? set --daemon or $FERRY_SOCKET)"));
}

std::unique_ptr<grpc::ClientContext> Connection::NewContext(
    absl::Duration timeout) const {
  auto context = std::make_unique<grpc::ClientContext>();
  if (timeout <= absl::ZeroDuration()) timeout = rpc_timeout_;
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return context;
}

}  // namespace ferry
