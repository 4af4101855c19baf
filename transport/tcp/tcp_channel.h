// The tcp backend: a Channel between two daemons over one TCP connection.
//
// Send writes the bucket itself, on the calling thread: the header, then
// the payload a batch of pieces (512 KiB) per sendmsg, each piece
// checksummed just before it goes, then the checksum in the trailer. A
// segment that is contiguous in the source and at least 64 KiB goes
// straight from the source; the rest (strided boxes, small boxes) is packed
// into a cache-sized scratch buffer first. So a contiguous byte is read
// from memory once, by the checksum, and the kernel's copy finds it in
// cache; nothing is packed into a bucket-sized buffer. Send returns when
// the kernel holds the whole bucket; the socket's buffers (4 MiB each way)
// are the pipeline between the two ends.
//
// The receiver reads the header, checks the bucket id and size it expects,
// then reads the payload a segment at a time (straight into the destination
// when the destination box is contiguous there, else into staging and
// unpacked), checksumming as it goes, and compares with the trailer. See
// wire_format.h.
//
// Memory: the sender's scratch is 512 KiB (or the largest segment), the
// receiver's staging a segment.
//
// One connection carries one direction in practice (the daemon opens one per
// source -> destination node pair), though either end may Send or Receive.
//
// Lifetime and threading: as Channel (transport.h): one owning thread makes
// every call. The channel owns its socket; the destructor closes it.
// The listener is owned by one thread too.
#ifndef FERRY_TRANSPORT_TCP_TCP_CHANNEL_H_
#define FERRY_TRANSPORT_TCP_TCP_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/tcp/socket_io.h"
#include "transport/transport.h"

namespace ferry {

struct TcpChannelOptions {
  TcpSocketOptions socket;
  // Bytes packed-and-checksummed or received-checksummed-and-unpacked at a
  // time; sized to stay in a core's L2 cache.
  int64_t segment_bytes = 256 << 10;
  // Non-empty: bytes the connecting side writes first on the connection,
  // before any framing, and the accepting side reads and compares first
  // (Peer.OpenChannel's connection token: binds a connection to a channel
  // and epoch). Both ends must set the same token.
  std::string connection_token;
};

// Accepts channels from peer daemons. Always viable: plain sockets.
// Callers outside tests hold it as a ChannelListener (ListenTcp).
class TcpListener : public ChannelListener {
 public:
  // Binds host:port and listens; port 0 picks an ephemeral port, which
  // port() reports. An empty host listens on every address.
  static absl::StatusOr<std::unique_ptr<TcpListener>> Listen(
      const std::string& host, int port, const TcpChannelOptions& options = {});

  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;

  int port() const override { return port_; }
  // The next connection, as a channel. DEADLINE_EXCEEDED when none comes.
  // With options.connection_token: PERMISSION_DENIED (connection closed)
  // when the first bytes are not the token; call again for the next one.
  absl::StatusOr<std::unique_ptr<Channel>> Accept(
      absl::Time deadline) override;

 private:
  TcpListener(ScopedFd fd, int port, const TcpChannelOptions& options);

  const ScopedFd fd_;
  const int port_;
  const TcpChannelOptions options_;
};

// The tcp backend's factory: a listener (TcpListener::Listen) and the
// connecting end. UNAVAILABLE when nobody listens there.
absl::StatusOr<std::unique_ptr<ChannelListener>> ListenTcp(
    const std::string& host, int port, const TcpChannelOptions& options = {});

// Connects to a peer's TcpListener. UNAVAILABLE when nobody listens there.
absl::StatusOr<std::unique_ptr<Channel>> ConnectTcpChannel(
    const std::string& host, int port, absl::Time deadline,
    const TcpChannelOptions& options = {});

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TCP_TCP_CHANNEL_H_
