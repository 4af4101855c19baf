#include "transport/tcp/socket_io.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdint>
#include <limits>
#include <memory>

#include "absl/strings/str_cat.h"
#include "transport/os_error.h"

namespace ferry {
namespace {

// Waits until `fd` is ready for `events`. DEADLINE_EXCEEDED when the
// deadline passes first; errors and hang-ups count as ready so that the
// next call on the fd reports them.
absl::Status WaitReady(int fd, short events, absl::Time deadline,
                       absl::string_view what) {
  while (true) {
    int timeout_ms = -1;
    if (deadline != absl::InfiniteFuture()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        return absl::DeadlineExceededError(
            absl::StrCat(what, ": deadline exceeded"));
      }
      // Round up so that a wait never ends just before the deadline.
      const int64_t ms = absl::ToInt64Milliseconds(left + absl::Microseconds(999));
      timeout_ms = static_cast<int>(std::min<int64_t>(ms, INT_MAX));
    }
    struct pollfd p = {fd, events, 0};
    const int n = ::poll(&p, 1, timeout_ms);
    if (n > 0) return absl::OkStatus();
    if (n < 0 && errno != EINTR) {
      return ErrnoStatus(absl::StrCat("poll(", what, ")"), errno);
    }
    // Timed out or interrupted: loop, and the deadline check decides.
  }
}

std::string AddressToString(const struct sockaddr* addr) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (addr->sa_family == AF_INET) {
    const auto* in = reinterpret_cast<const struct sockaddr_in*>(addr);
    ::inet_ntop(AF_INET, &in->sin_addr, host, sizeof(host));
    port = ntohs(in->sin_port);
    return absl::StrCat(host, ":", port);
  }
  if (addr->sa_family == AF_INET6) {
    const auto* in6 = reinterpret_cast<const struct sockaddr_in6*>(addr);
    ::inet_ntop(AF_INET6, &in6->sin6_addr, host, sizeof(host));
    port = ntohs(in6->sin6_port);
    return absl::StrCat("[", host, "]:", port);
  }
  return "unknown address";
}

absl::Status SetIntOption(int fd, int level, int name, int value,
                          absl::string_view option, absl::string_view what) {
  if (::setsockopt(fd, level, name, &value, sizeof(value)) != 0) {
    return ErrnoStatus(absl::StrCat("setsockopt(", what, ", ", option, ")"),
                       errno);
  }
  return absl::OkStatus();
}

// Options every data socket gets. Buffer sizes must be set before
// connect/listen to take effect on the window scale.
absl::Status ConfigureSocket(int fd, const TcpSocketOptions& options,
                             absl::string_view what) {
  if (options.buffer_bytes > 0) {
    absl::Status s = SetIntOption(fd, SOL_SOCKET, SO_SNDBUF,
                                  options.buffer_bytes, "SO_SNDBUF", what);
    if (s.ok()) {
      s = SetIntOption(fd, SOL_SOCKET, SO_RCVBUF, options.buffer_bytes,
                       "SO_RCVBUF", what);
    }
    if (!s.ok()) return s;
  }
  if (options.dead_after > absl::ZeroDuration()) {
    const int ms = static_cast<int>(std::max<int64_t>(
        1, std::min<int64_t>(absl::ToInt64Milliseconds(options.dead_after),
                             std::numeric_limits<int>::max())));
    absl::Status s = SetIntOption(fd, SOL_SOCKET, SO_KEEPALIVE, 1,
                                  "SO_KEEPALIVE", what);
    if (s.ok()) {
      s = SetIntOption(fd, IPPROTO_TCP, TCP_KEEPIDLE, 1, "TCP_KEEPIDLE", what);
    }
    if (s.ok()) {
      s = SetIntOption(fd, IPPROTO_TCP, TCP_KEEPINTVL, 1, "TCP_KEEPINTVL",
                       what);
    }
    // With keepalive on, TCP_USER_TIMEOUT also bounds unanswered probes.
    if (s.ok()) {
      s = SetIntOption(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, ms,
                       "TCP_USER_TIMEOUT", what);
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// Binds `fd` to `host` (any port) before it connects: the connection
// leaves from that address, so from the NIC that holds it.
absl::Status BindLocal(int fd, const std::string& host, int family,
                       absl::string_view what) {
  struct addrinfo hints = {};
  hints.ai_family = family;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICHOST | AI_PASSIVE;
  struct addrinfo* result = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), "0", &hints, &result);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local address ", host, " for ", what, ": ",
                     ::gai_strerror(rc)));
  }
  const int bound = ::bind(fd, result->ai_addr, result->ai_addrlen);
  const int err = errno;
  ::freeaddrinfo(result);
  if (bound != 0) {
    return ErrnoStatus(absl::StrCat("bind(", host, ") for ", what), err);
  }
  return absl::OkStatus();
}

// Nagle would hold back a bucket's small header behind the previous
// bucket's tail; the channel writes large buffers anyway.
absl::Status SetNoDelay(int fd, absl::string_view what) {
  return SetIntOption(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY", what);
}

struct AddrInfoDeleter {
  void operator()(struct addrinfo* ai) const { ::freeaddrinfo(ai); }
};
using AddrInfoList = std::unique_ptr<struct addrinfo, AddrInfoDeleter>;

absl::StatusOr<AddrInfoList> Resolve(const std::string& host, int port,
                                     bool passive) {
  if (port < 0 || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("tcp port ", port, " is out of range"));
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  struct addrinfo* result = nullptr;
  const std::string service = absl::StrCat(port);
  const int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(),
                               service.c_str(), &hints, &result);
  if (rc == EAI_SYSTEM) {
    return ErrnoStatus(absl::StrCat("getaddrinfo(", host, ")"), errno);
  }
  if (rc != 0) {
    // Not errno: getaddrinfo has its own codes. A name that does not
    // resolve may resolve later (DNS), so UNAVAILABLE.
    return absl::UnavailableError(
        absl::StrCat("getaddrinfo(", host, "): ", ::gai_strerror(rc)));
  }
  return AddrInfoList(result);
}

}  // namespace

ScopedFd& ScopedFd::operator=(ScopedFd&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

ScopedFd::~ScopedFd() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<ScopedFd> ConnectTcp(const std::string& host, int port,
                                    absl::Time deadline,
                                    const TcpSocketOptions& options) {
  absl::StatusOr<AddrInfoList> addrs = Resolve(host, port, false);
  if (!addrs.ok()) return addrs.status();
  absl::Status last = absl::UnavailableError(
      absl::StrCat("connect(", host, ":", port, "): no address"));
  for (struct addrinfo* ai = addrs->get(); ai != nullptr; ai = ai->ai_next) {
    const std::string what =
        absl::StrCat(host, ":", port, " (", AddressToString(ai->ai_addr), ")");
    ScopedFd fd(::socket(ai->ai_family,
                         ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                         ai->ai_protocol));
    if (fd.get() < 0) {
      last = ErrnoStatus(absl::StrCat("socket(", what, ")"), errno);
      continue;
    }
    if (absl::Status s = ConfigureSocket(fd.get(), options, what); !s.ok()) {
      return s;
    }
    if (!options.local_host.empty()) {
      absl::Status s =
          BindLocal(fd.get(), options.local_host, ai->ai_family, what);
      if (!s.ok()) {
        last = s;
        continue;  // e.g. an IPv4 rail for an IPv6 address of the host
      }
    }
    if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) {
        last = ErrnoStatus(absl::StrCat("connect(", what, ")"), errno);
        continue;
      }
      absl::Status s = WaitReady(fd.get(), POLLOUT, deadline,
                                 absl::StrCat("connect(", what, ")"));
      if (!s.ok()) return s;  // the deadline covers all addresses
      int err = 0;
      socklen_t len = sizeof(err);
      if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) {
        err = errno;
      }
      if (err != 0) {
        last = ErrnoStatus(absl::StrCat("connect(", what, ")"), err);
        continue;
      }
    }
    if (absl::Status s = SetNoDelay(fd.get(), what); !s.ok()) return s;
    return fd;
  }
  return last;
}

absl::StatusOr<ScopedFd> ListenTcp(const std::string& host, int port,
                                   const TcpSocketOptions& options,
                                   int* bound_port) {
  absl::StatusOr<AddrInfoList> addrs = Resolve(host, port, true);
  if (!addrs.ok()) return addrs.status();
  const struct addrinfo* ai = addrs->get();
  const std::string what = absl::StrCat(AddressToString(ai->ai_addr));
  ScopedFd fd(::socket(ai->ai_family,
                       ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC,
                       ai->ai_protocol));
  if (fd.get() < 0) {
    return ErrnoStatus(absl::StrCat("socket(", what, ")"), errno);
  }
  // A restarted daemon rebinds its port while old connections linger in
  // TIME_WAIT.
  absl::Status s =
      SetIntOption(fd.get(), SOL_SOCKET, SO_REUSEADDR, 1, "SO_REUSEADDR", what);
  if (s.ok()) s = ConfigureSocket(fd.get(), options, what);
  if (!s.ok()) return s;
  if (::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    return ErrnoStatus(absl::StrCat("bind(", what, ")"), errno);
  }
  if (::listen(fd.get(), SOMAXCONN) != 0) {
    return ErrnoStatus(absl::StrCat("listen(", what, ")"), errno);
  }
  struct sockaddr_storage bound = {};
  socklen_t len = sizeof(bound);
  if (::getsockname(fd.get(), reinterpret_cast<struct sockaddr*>(&bound),
                    &len) != 0) {
    return ErrnoStatus(absl::StrCat("getsockname(", what, ")"), errno);
  }
  *bound_port =
      bound.ss_family == AF_INET6
          ? ntohs(reinterpret_cast<struct sockaddr_in6*>(&bound)->sin6_port)
          : ntohs(reinterpret_cast<struct sockaddr_in*>(&bound)->sin_port);
  return fd;
}

absl::StatusOr<ScopedFd> AcceptTcp(int listen_fd, absl::Time deadline,
                                   std::string* peer) {
  while (true) {
    struct sockaddr_storage addr = {};
    socklen_t len = sizeof(addr);
    const int fd = ::accept4(listen_fd, reinterpret_cast<struct sockaddr*>(&addr),
                             &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      ScopedFd owned(fd);
      *peer = AddressToString(reinterpret_cast<struct sockaddr*>(&addr));
      if (absl::Status s = SetNoDelay(fd, *peer); !s.ok()) return s;
      return owned;
    }
    // A connection that died in the backlog is the client's problem; wait
    // for the next one.
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return ErrnoStatus("accept4(listener)", errno);
    }
    absl::Status s = WaitReady(listen_fd, POLLIN, deadline, "accept4(listener)");
    if (!s.ok()) return s;
  }
}

absl::Status ReadFull(int fd, uint8_t* buf, size_t n, absl::Time deadline,
                      absl::string_view what, size_t* done) {
  *done = 0;
  while (*done < n) {
    const ssize_t got = ::recv(fd, buf + *done, n - *done, 0);
    if (got > 0) {
      *done += static_cast<size_t>(got);
      continue;
    }
    if (got == 0) {
      return absl::UnavailableError(absl::StrCat(
          what, ": the peer closed the connection after ", *done, " of ", n,
          " bytes"));
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return ErrnoStatus(absl::StrCat("recv(", what, ")"), errno);
    }
    absl::Status s = WaitReady(fd, POLLIN, deadline, what);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(s.message(), " after ", *done,
                                                 " of ", n, " bytes"));
    }
  }
  return absl::OkStatus();
}

absl::Status WriteFull(int fd, struct iovec* iov, int count,
                       absl::Time deadline, absl::string_view what) {
  while (count > 0) {
    if (iov->iov_len == 0) {
      ++iov;
      --count;
      continue;
    }
    struct msghdr msg = {};
    msg.msg_iov = iov;
    msg.msg_iovlen = static_cast<size_t>(count);
    ssize_t sent = ::sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (sent < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return ErrnoStatus(absl::StrCat("sendmsg(", what, ")"), errno);
      }
      absl::Status s = WaitReady(fd, POLLOUT, deadline, what);
      if (!s.ok()) return s;
      continue;
    }
    // Advance past what the kernel took.
    while (count > 0 && static_cast<size_t>(sent) >= iov->iov_len) {
      sent -= static_cast<ssize_t>(iov->iov_len);
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<uint8_t*>(iov->iov_base) + sent;
      iov->iov_len -= static_cast<size_t>(sent);
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
