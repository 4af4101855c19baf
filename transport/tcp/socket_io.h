// Sockets with deadlines: the system calls under the tcp channel.
//
// Every socket here is non-blocking, and every wait is a poll() bounded by
// an absl::Time deadline, so no call on the data path can hang past its
// deadline. Errors come back as Status through ErrnoStatus, naming the call
// and the peer. SIGPIPE is never raised (MSG_NOSIGNAL): a peer that went
// away is UNAVAILABLE, not a dead daemon.
#ifndef FERRY_TRANSPORT_TCP_SOCKET_IO_H_
#define FERRY_TRANSPORT_TCP_SOCKET_IO_H_

#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace ferry {

// An owned file descriptor, closed on destruction.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;
  ScopedFd(ScopedFd&& other) noexcept : fd_(other.release()) {}
  ScopedFd& operator=(ScopedFd&& other) noexcept;
  ~ScopedFd();

  int get() const { return fd_; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

struct TcpSocketOptions {
  // SO_SNDBUF and SO_RCVBUF, so that a 64 MiB bucket is not throttled by a
  // small default window; the kernel caps them at net.core.[rw]mem_max.
  // 0 leaves the kernel's autotuning alone.
  int buffer_bytes = 4 << 20;
  // The local address a connection leaves from ("" the kernel's choice):
  // a rail's address, so that the connection takes that NIC
  // (docs/operations.md, "Rails").
  std::string local_host;
  // How long a connection may go without its peer acknowledging data or
  // answering a keepalive probe before it fails (TCP_USER_TIMEOUT, with
  // keepalive probes every second after a second of silence): a link that
  // went down fails the channel in about this long instead of the
  // kernel's ~15 minutes. Zero: the kernel's defaults.
  absl::Duration dead_after = absl::ZeroDuration();
};

// Connects to host:port (any address getaddrinfo gives, in order).
// UNAVAILABLE when refused or unreachable, DEADLINE_EXCEEDED past deadline.
absl::StatusOr<ScopedFd> ConnectTcp(const std::string& host, int port,
                                    absl::Time deadline,
                                    const TcpSocketOptions& options);
// Binds host:port (port 0: an ephemeral port, reported in *bound_port) and
// listens. An empty host binds every address.
absl::StatusOr<ScopedFd> ListenTcp(const std::string& host, int port,
                                   const TcpSocketOptions& options,
                                   int* bound_port);
// Accepts one connection; *peer is its "address:port".
// Accepted sockets inherit the listener's buffer sizes and liveness.
absl::StatusOr<ScopedFd> AcceptTcp(int listen_fd, absl::Time deadline,
                                   std::string* peer);

// Reads exactly `n` bytes. *done counts the bytes read, also on error, so a
// caller can tell whether anything was consumed. UNAVAILABLE when the peer
// closes first; DEADLINE_EXCEEDED past `deadline` (bytes already in the
// socket are still read when the deadline has passed). `what` names the
// peer and the object for messages.
absl::Status ReadFull(int fd, uint8_t* buf, size_t n, absl::Time deadline,
                      absl::string_view what, size_t* done);
// Writes all of iov[0..count) (modifying the array as it goes).
absl::Status WriteFull(int fd, struct iovec* iov, int count,
                       absl::Time deadline, absl::string_view what);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TCP_SOCKET_IO_H_
