#include "daemon/security/tls_credentials.h"

#include <openssl/pem.h>
#include <openssl/x509.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace ferry {
namespace {

constexpr char kCommonName[] = "x509_common_name";

absl::StatusOr<std::string> ReadPem(const std::string& path,
                                    const char* flag) {
  if (path.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "TLS needs --", flag, " (with --tls_cert, --tls_key and --tls_ca; "
        "deploy/make_certs.sh makes them)"));
  }
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, " cannot be read"));
  }
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().find("-----BEGIN") == std::string::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, "=", path, " is not a PEM file"));
  }
  return text.str();
}

// The subject CN of the first certificate of a PEM chain, "" if none.
std::string CommonNameOf(const std::string& pem) {
  BIO* bio = BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size()));
  if (bio == nullptr) return "";
  X509* cert = PEM_read_bio_X509(bio, nullptr, nullptr, nullptr);
  BIO_free(bio);
  if (cert == nullptr) return "";
  char name[256] = {0};
  const int n = X509_NAME_get_text_by_NID(X509_get_subject_name(cert),
                                          NID_commonName, name, sizeof(name));
  X509_free(cert);
  return n > 0 ? std::string(name, static_cast<size_t>(n)) : "";
}

// Refuses every call whose TLS handshake did not verify a client
// certificate. The handshake already verified any certificate that was
// presented against the CA; this is the one place that also refuses the
// callers that presented none.
class RequireClientCertificate final : public grpc::AuthMetadataProcessor {
 public:
  bool IsBlocking() const override { return false; }
  grpc::Status Process(const InputMetadata&, grpc::AuthContext* context,
                       OutputMetadata*, OutputMetadata*) override {
    if (context != nullptr && context->IsPeerAuthenticated() &&
        !context->FindPropertyValues(kCommonName).empty()) {
      return grpc::Status::OK;
    }
    return grpc::Status(
        grpc::StatusCode::UNAUTHENTICATED,
        "ferryd's TCP port serves only callers with a client certificate "
        "signed by the cluster CA (ferryctl --tls_cert/--tls_key/--tls_ca)");
  }
};

}  // namespace

absl::StatusOr<std::shared_ptr<const TlsCredentials>> TlsCredentials::Load(
    const TlsFiles& files) {
  std::shared_ptr<TlsCredentials> c(new TlsCredentials());
  absl::StatusOr<std::string> cert = ReadPem(files.cert, "tls_cert");
  if (!cert.ok()) return cert.status();
  absl::StatusOr<std::string> ca = ReadPem(files.ca, "tls_ca");
  if (!ca.ok()) return ca.status();
  // The key is the daemon's identity: one that others can read is one that
  // others can use.
  struct stat st;
  if (!files.key.empty() && ::stat(files.key.c_str(), &st) == 0 &&
      ((st.st_mode & 077) != 0 || st.st_uid != ::geteuid())) {
    return absl::PermissionDeniedError(absl::StrCat(
        "--tls_key=", files.key, " must belong to uid ", ::geteuid(),
        " and be mode 0600 or stricter (it is uid ", st.st_uid, ", mode ",
        absl::StrFormat("%04o", st.st_mode & 0777), ")"));
  }
  absl::StatusOr<std::string> key = ReadPem(files.key, "tls_key");
  if (!key.ok()) return key.status();
  c->identity_ = CommonNameOf(*cert);
  if (c->identity_.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--tls_cert=", files.cert, ": no certificate with a subject CN"));
  }
  c->cert_pem_ = *std::move(cert);
  c->key_pem_ = *std::move(key);
  c->ca_pem_ = *std::move(ca);
  return std::shared_ptr<const TlsCredentials>(std::move(c));
}

std::shared_ptr<grpc::ServerCredentials> TlsCredentials::ServerCredentials()
    const {
  grpc::SslServerCredentialsOptions options(
      GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY);
  options.pem_root_certs = ca_pem_;
  options.pem_key_cert_pairs.push_back({key_pem_, cert_pem_});
  std::shared_ptr<grpc::ServerCredentials> creds =
      grpc::SslServerCredentials(options);
  creds->SetAuthMetadataProcessor(
      std::make_shared<RequireClientCertificate>());
  return creds;
}

std::shared_ptr<grpc::ChannelCredentials> TlsCredentials::ChannelCredentials()
    const {
  grpc::SslCredentialsOptions options;
  options.pem_root_certs = ca_pem_;
  options.pem_private_key = key_pem_;
  options.pem_cert_chain = cert_pem_;
  return grpc::SslCredentials(options);
}

std::string CertificateIdentity(const grpc::ServerContext& context) {
  std::shared_ptr<const grpc::AuthContext> auth = context.auth_context();
  if (auth == nullptr || !auth->IsPeerAuthenticated()) return "";
  std::vector<grpc::string_ref> names = auth->FindPropertyValues(kCommonName);
  if (names.empty()) return "";
  return std::string(names[0].data(), names[0].size());
}

}  // namespace ferry
