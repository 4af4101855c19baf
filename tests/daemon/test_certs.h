// Test certificates: a cluster CA and one certificate per node or
// operator name, made on first use by deploy/make_certs.sh (the operators'
// own tool, so the tests also check it) in a directory of this test
// process, with subjectAltNames for 127.0.0.1 and localhost.
#ifndef FERRY_TESTS_DAEMON_TEST_CERTS_H_
#define FERRY_TESTS_DAEMON_TEST_CERTS_H_

#include <memory>
#include <string>
#include <vector>

#include "daemon/security/tls_credentials.h"
#include "grpcpp/security/credentials.h"

namespace ferry {
namespace testing {

// The files of `name`'s certificate (CN = name) and the CA. Thread-safe.
TlsFiles TestTls(const std::string& name);

// A second, unrelated CA's certificate for `name` (a stranger's).
TlsFiles ForeignTls(const std::string& name);

// ferryd's flags for `node`'s certificate: --tls_cert, --tls_key, --tls_ca.
std::vector<std::string> TlsFlags(const std::string& node);

// Channel credentials presenting `files` (a TCP client of ferryd).
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsOf(
    const TlsFiles& files);

// A channel to a ferryd's TCP port as `name` of the test cluster.
std::shared_ptr<grpc::Channel> TcpChannel(const std::string& target,
                                          const std::string& name = "operator");

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_DAEMON_TEST_CERTS_H_
