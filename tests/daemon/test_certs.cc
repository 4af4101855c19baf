#include "tests/daemon/test_certs.h"

#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <mutex>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"

namespace ferry {
namespace testing {
namespace {

std::string MakeCertsScript() {
  for (const char* var : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* dir = std::getenv(var);
    if (dir == nullptr) continue;
    const std::string path = absl::StrCat(dir, "/ferry/deploy/make_certs.sh");
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return "deploy/make_certs.sh";  // run from the workspace root
}

TlsFiles Make(const std::string& ca_dir_tag, const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::string> dirs;  // by tag
  static std::map<std::string, TlsFiles> made;     // by tag/name
  std::lock_guard<std::mutex> lock(mu);
  const std::string key = ca_dir_tag + "/" + name;
  auto it = made.find(key);
  if (it != made.end()) return it->second;
  std::string& dir = dirs[ca_dir_tag];
  if (dir.empty()) {
    char tmpl[] = "/tmp/ferry-certs-XXXXXX";
    char* d = ::mkdtemp(tmpl);
    if (d == nullptr) throw std::runtime_error("mkdtemp for test certs");
    dir = d;
  }
  const std::string cmd =
      absl::StrCat(MakeCertsScript(), " '", dir, "' '", name,
                   "' IP:127.0.0.1 DNS:localhost >/dev/null");
  if (std::system(cmd.c_str()) != 0) {
    throw std::runtime_error("test certificates: `" + cmd + "` failed");
  }
  TlsFiles files;
  files.cert = absl::StrCat(dir, "/", name, ".pem");
  files.key = absl::StrCat(dir, "/", name, ".key");
  files.ca = absl::StrCat(dir, "/ca.pem");
  made[key] = files;
  return files;
}

}  // namespace

TlsFiles TestTls(const std::string& name) { return Make("cluster", name); }

TlsFiles ForeignTls(const std::string& name) { return Make("foreign", name); }

std::vector<std::string> TlsFlags(const std::string& node) {
  const TlsFiles f = TestTls(node);
  return {"--tls_cert=" + f.cert, "--tls_key=" + f.key, "--tls_ca=" + f.ca};
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsOf(
    const TlsFiles& files) {
  auto read = [](const std::string& path) {
    std::ifstream in(path);
    std::stringstream text;
    text << in.rdbuf();
    return text.str();
  };
  grpc::SslCredentialsOptions ssl;
  ssl.pem_cert_chain = read(files.cert);
  ssl.pem_private_key = read(files.key);
  ssl.pem_root_certs = read(files.ca);
  return grpc::SslCredentials(ssl);
}

std::shared_ptr<grpc::Channel> TcpChannel(const std::string& target,
                                          const std::string& name) {
  return grpc::CreateChannel(target, ChannelCredentialsOf(TestTls(name)));
}

}  // namespace testing
}  // namespace ferry
