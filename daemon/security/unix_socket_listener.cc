#include "daemon/security/unix_socket_listener.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "daemon/security/caller_identity.h"
#include "glog/logging.h"
#include "grpcpp/server_posix.h"

namespace ferry {

absl::StatusOr<UnixSocketAccess> UnixSocketAccess::Parse(
    const std::string& text) {
  UnixSocketAccess access;
  if (text.empty()) return access;
  if (text == "all") {
    access.any_uid = true;
    return access;
  }
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    uint32_t uid = 0;
    if (!absl::SimpleAtoi(part, &uid)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--client_uids: '", part, "' is not a uid (use numbers, or all)"));
    }
    access.uids.insert(static_cast<uid_t>(uid));
  }
  return access;
}
namespace {

absl::Status Errno(absl::string_view call, absl::string_view path) {
  return absl::InternalError(
      absl::StrCat(call, "(", path, ") failed: ", std::strerror(errno)));
}

// mkdir -p of the socket's directory; the last component gets `mode`
// (0700, or 0711 when other users may reach the socket in it).
absl::Status PrepareDirectory(const std::string& dir, mode_t mode) {
  if (dir.empty()) return absl::OkStatus();
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    const std::string prefix = dir.substr(0, pos);
    if (::mkdir(prefix.c_str(), 0700) != 0 && errno != EEXIST) {
      return Errno("mkdir", prefix);
    }
  }
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) return Errno("stat", dir);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is not a directory"));
  }
  if (st.st_uid != ::getuid()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "socket directory ", dir, " belongs to uid ", st.st_uid,
        ", not to this daemon's uid ", ::getuid()));
  }
  if ((st.st_mode & 0777) != mode && ::chmod(dir.c_str(), mode) != 0) {
    return Errno("chmod", dir);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<UnixSocketListener>> UnixSocketListener::Listen(
    const std::string& path, CallerIdentity* callers,
    UnixSocketAccess access) {
  sockaddr_un addr;
  std::memset(&addr, 0, sizeof(addr));
  addr.sun_family = AF_UNIX;
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "socket path '", path, "' must be 1 to ", sizeof(addr.sun_path) - 1,
        " characters"));
  }
  std::memcpy(addr.sun_path, path.data(), path.size());
  const size_t slash = path.rfind('/');
  absl::Status s =
      PrepareDirectory(slash == std::string::npos ? "" : path.substr(0, slash),
                       access.others() ? 0711 : 0700);
  if (!s.ok()) return s;

  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return Errno("socket", path);
  // A socket file left by a daemon that died: remove it, unless someone
  // still answers on it.
  if (::access(path.c_str(), F_OK) == 0) {
    const int probe = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const bool live =
        probe >= 0 &&
        ::connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
    if (probe >= 0) ::close(probe);
    if (live) {
      ::close(fd);
      return absl::FailedPreconditionError(absl::StrCat(
          "another process is serving ", path, "; is ferryd running?"));
    }
    ::unlink(path.c_str());
  }
  // Create the file 0600 from the start (umask), then make sure.
  const mode_t old_mask = ::umask(0177);
  const int rc = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  ::umask(old_mask);
  if (rc != 0) {
    absl::Status e = Errno("bind", path);
    ::close(fd);
    return e;
  }
  if (::chmod(path.c_str(), access.others() ? 0666 : 0600) != 0 ||
      ::listen(fd, 128) != 0) {
    absl::Status e = Errno("chmod/listen", path);
    ::close(fd);
    return e;
  }
  return std::unique_ptr<UnixSocketListener>(new UnixSocketListener(path, fd, callers, std::move(access)));
}

UnixSocketListener::UnixSocketListener(std::string path, int fd,
                                       CallerIdentity* callers,
                                       UnixSocketAccess access)
    : path_(std::move(path)),
      fd_(fd),
      callers_(callers),
      access_(std::move(access)) {}

bool UnixSocketListener::Admits(uid_t uid) const {
  return uid == ::getuid() || uid == 0 || access_.any_uid ||
         access_.uids.count(uid) > 0;
}

UnixSocketListener::~UnixSocketListener() { Stop(); }

void UnixSocketListener::Start(grpc::Server* server) {
  thread_ = std::thread([this, server] { AcceptLoop(server); });
}

void UnixSocketListener::Stop() {
  stopping_.store(true);
  if (thread_.joinable()) thread_.join();
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
    ::unlink(path_.c_str());
  }
}

void UnixSocketListener::AcceptLoop(grpc::Server* server) {
  const uid_t self = ::getuid();
  while (!stopping_.load()) {
    pollfd p{fd_, POLLIN, 0};
    const int ready = ::poll(&p, 1, 100);
    if (ready <= 0) continue;
    const int conn = ::accept4(fd_, nullptr, nullptr,
                               SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (conn < 0) {
      if (errno != EAGAIN && errno != EINTR) {
        PLOG(WARNING) << "accept on " << path_;
      }
      continue;
    }
    ucred cred;
    socklen_t len = sizeof(cred);
    if (::getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      PLOG(WARNING) << "SO_PEERCRED on " << path_ << "; closing";
      ::close(conn);
      continue;
    }
    if (!Admits(cred.uid)) {
      LOG(WARNING) << "refused a connection on " << path_ << " from pid "
                   << cred.pid << " uid " << cred.uid
                   << ": only uid " << self
                   << ", root and --client_uids may connect";
      refused_.fetch_add(1);
      ::close(conn);
      continue;
    }
    // Recorded before gRPC sees the fd, so no call on it is unknown.
    callers_->RecordUnixConnection(conn, cred.pid, cred.uid, cred.gid);
    grpc::AddInsecureChannelFromFd(server, conn);  // gRPC owns conn now
  }
}

}  // namespace ferry
