// TlsCredentials: mutual TLS for everything ferryd serves and calls over
// TCP (docs/api.md, "Authentication").
//
// Every daemon of a cluster, and every remote ferryctl, holds a certificate
// signed by the cluster's CA (deploy/make_certs.sh makes them). The
// certificate's common name is its holder's identity: a daemon's is its
// node name, so a member can only join, heartbeat and forward as the node
// its certificate names, never as another. ferryd's TCP port asks every
// caller for a certificate; a call without a verified one is UNAUTHENTICATED
// before any handler runs (an AuthMetadataProcessor, one place for every
// service). Calls that arrive on the unix socket carry no certificate:
// they are authenticated by SO_PEERCRED instead (caller_identity.h).
//
// Owner: the Server (and tests); immutable after Load.
#ifndef FERRY_DAEMON_SECURITY_TLS_CREDENTIALS_H_
#define FERRY_DAEMON_SECURITY_TLS_CREDENTIALS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_context.h"

namespace ferry {

// Where a daemon's TLS files are (PEM).
struct TlsFiles {
  std::string cert;  // this daemon's certificate (chain)
  std::string key;   // its private key: mode 0600 (or stricter), ours
  std::string ca;    // the cluster CA that signs every peer's certificate

  bool any() const { return !cert.empty() || !key.empty() || !ca.empty(); }
};

class TlsCredentials {
 public:
  // Reads the three files. INVALID_ARGUMENT naming the flag for a missing
  // one; PERMISSION_DENIED for a key that others may read.
  static absl::StatusOr<std::shared_ptr<const TlsCredentials>> Load(
      const TlsFiles& files);

  // For the TCP listener: asks for a client certificate, verifies it
  // against the CA, and refuses (UNAUTHENTICATED) every call without one.
  std::shared_ptr<grpc::ServerCredentials> ServerCredentials() const;
  // For calls to other daemons: presents our certificate, verifies theirs
  // (against the CA and the host name or IP they are reached at).
  std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials() const;

  // The identity (certificate CN) this daemon presents.
  const std::string& identity() const { return identity_; }

 private:
  TlsCredentials() = default;
  std::string cert_pem_, key_pem_, ca_pem_;
  std::string identity_;
};

// The verified certificate CN of the caller of an RPC that came over TLS;
// "" when the call came over the unix socket (no certificate).
std::string CertificateIdentity(const grpc::ServerContext& context);

}  // namespace ferry

#endif  // FERRY_DAEMON_SECURITY_TLS_CREDENTIALS_H_
