#include "bench/daemon/bench_figures.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <thread>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace bench {
namespace {

absl::Status SocketError(const char* call) {
  return absl::UnavailableError(absl::StrCat(call, ": errno ", errno));
}

}  // namespace

absl::StatusOr<double> RawLoopbackSeconds(const uint8_t* src, uint8_t* dst,
                                          int64_t bytes) {
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  if (listener < 0) return SocketError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  if (::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 ||
      ::listen(listener, 1) != 0 ||
      ::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    ::close(listener);
    return SocketError("bind/listen");
  }
  const int out = ::socket(AF_INET, SOCK_STREAM, 0);
  if (out < 0 ||
      ::connect(out, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(listener);
    if (out >= 0) ::close(out);
    return SocketError("connect");
  }
  const int in = ::accept(listener, nullptr, nullptr);
  ::close(listener);
  if (in < 0) {
    ::close(out);
    return SocketError("accept");
  }
  constexpr int64_t kChunk = int64_t{4} << 20;
  const absl::Time start = absl::Now();
  int64_t got = 0;
  std::thread receiver([&] {
    while (got < bytes) {
      const ssize_t n = ::recv(in, dst + got, bytes - got, 0);
      if (n <= 0) return;
      got += n;
    }
  });
  int64_t sent = 0;
  while (sent < bytes) {
    const ssize_t n =
        ::send(out, src + sent, std::min(kChunk, bytes - sent), 0);
    if (n <= 0) break;
    sent += n;
  }
  ::shutdown(out, SHUT_WR);
  receiver.join();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  ::close(out);
  ::close(in);
  if (sent < bytes || got < bytes) {
    return absl::DataLossError(absl::StrCat("raw loopback stream moved ", got,
                                            " of ", bytes, " bytes"));
  }
  return seconds;
}

}  // namespace bench
}  // namespace ferry
