#include "daemon/security/caller_identity.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "daemon/security/tls_credentials.h"

namespace ferry {

void CallerIdentity::RecordUnixConnection(int fd, pid_t pid, uid_t uid,
                                          gid_t gid) {
  absl::MutexLock lock(&mu_);
  unix_[fd] = UnixPeer{pid, uid, gid};
}

absl::StatusOr<Caller> CallerIdentity::Of(
    const grpc::ServerContext& context) const {
  Caller caller;
  const std::string peer = context.peer();
  absl::string_view fd_text = peer;
  if (absl::ConsumePrefix(&fd_text, "fd:")) {
    int fd = -1;
    absl::MutexLock lock(&mu_);
    auto it = absl::SimpleAtoi(fd_text, &fd) ? unix_.find(fd) : unix_.end();
    if (it == unix_.end()) {
      return absl::UnauthenticatedError(absl::StrCat(
          "a connection ", peer, " that this daemon's unix socket did not "
          "accept"));
    }
    caller.transport = Caller::Transport::kUnixSocket;
    caller.pid = it->second.pid;
    caller.uid = it->second.uid;
    caller.gid = it->second.gid;
    return caller;
  }
  caller.certificate = CertificateIdentity(context);
  if (caller.certificate.empty()) {
    return absl::UnauthenticatedError(
        "this call came over TCP without a verified client certificate");
  }
  return caller;
}

absl::StatusOr<RegionAccess> RegistrationAccess(const Caller& caller,
                                                bool write) {
  if (!caller.unix_socket()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "memory can be registered only over the unix socket of the ferryd on "
        "the memory's node, where ferryd knows the caller's uid (this call "
        "came over TCP from ", caller.certificate, ")"));
  }
  RegionAccess access;
  access.check = true;
  access.uid = caller.uid;
  access.gid = caller.gid;
  access.write = write;
  return access;
}

absl::StatusOr<MapOptions> RegistrationMapping(
    const CallerIdentity& callers, const grpc::ServerContext& context,
    DeviceMemory* devices, bool write) {
  absl::StatusOr<Caller> caller = callers.Of(context);
  if (!caller.ok()) return caller.status();
  absl::StatusOr<RegionAccess> access = RegistrationAccess(*caller, write);
  if (!access.ok()) return access.status();
  MapOptions mapping;
  mapping.devices = devices;
  mapping.access = *access;
  return mapping;
}

}  // namespace ferry
