// The ucx backend: a Channel between two daemons over UCX (UCP tag
// messages), for clusters whose NICs TCP cannot drive at line rate
// (InfiniBand, RoCE) and for any transport UCX picks (shared memory
// between daemons on one host, tcp).
//
// Connection: the connecting end sends, the accepting end receives. The
// receiving end's UCP worker exists from listen time; the sender needs its
// address (UcxListener::worker_address), and ferryd passes it in
// Peer.OpenChannel's answer, over mutual TLS. It must come from an
// authenticated peer: UCX 1.13 aborts the process on a malformed worker
// address (an assertion in its address unpacking), so it is never read
// from the unauthenticated meeting connection. The two ends then meet over
// a plain TCP connection (the same listener/connect shape and connection
// token as the tcp backend), which stays open for the channel's life,
// idle: its end-of-file is how each end learns the other is gone, on every
// UCX transport. ConnectUcxChannel creates its endpoint at once; nothing
// waits for the peer to accept.
//
// Data: one tag message per bucket in the tcp backend's framing
// (wire_format.h): the header (id, payload bytes), the payload packed as
// bucket_segments.h lays it out, and the trailer (checksum). The sender packs and checksums
// into one of two staging buffers and returns; a sender thread hands the
// message to UCX (eager or rendezvous; zero-copy RDMA where the transport
// has it) and progresses until it completes, so bucket k travels while
// bucket k+1 is packed. The receiver probes the next message, checks its
// length against the bucket it expects before receiving a byte, receives
// it into its own staging, and then checks the header and unpacks segment
// by segment with the checksum.
//
// Why staging on both ends, even where UCX could send from and receive
// into the regions: they are client memory that a client may shrink
// (transport/memory_fault_guard.h). A fault inside UCX's progress could not
// be recovered (it holds UCX's state half-updated), while the copies into
// and out of staging run guarded. On a cluster this costs one memory pass
// per side next to a network pass.
//
// Peer failure: endpoints ask UCX to report a failed peer (error mode
// PEER) where the transports can; UCX 1.13's shared-memory transports
// cannot, and are used without it. A receiver that finds the stream out of
// step shuts the meeting connection, so a sender waiting on a message that
// will never be taken fails at once rather than at its deadline.
//
// Closing: a send that UCX completed at once may still sit in UCX's buffer
// on this side, so a channel whose last send was one flushes its endpoint
// (at most a second: the peer must take part) before closing it by force.
//
// Threads: each end has one UCP worker, used by one thread only
// (UCS_THREAD_MODE_SINGLE): the sender thread on the sending end, the
// owning thread's Receive on the receiving end. Waits sleep on the
// worker's event fd (and the TCP connection), not in a spin.
//
// Configuration: UcxChannelOptions::transports is UCX_TLS for the
// channel's UCP context (docs/operations.md, "UCX between nodes", says
// what a cluster sets); other UCX_* variables come from the environment.
#ifndef FERRY_TRANSPORT_UCX_UCX_CHANNEL_H_
#define FERRY_TRANSPORT_UCX_UCX_CHANNEL_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "transport/tcp/socket_io.h"
#include "transport/transport.h"

namespace ferry {

struct UcxChannelOptions {
  // UCX_TLS for this channel's context ("tcp", "sm", "rc,sm", ...); empty:
  // UCX's default, or UCX_TLS from the environment. Both ends should name
  // transports they share, or the endpoints cannot connect.
  std::string transports;
  // UCX_NET_DEVICES for this channel's context ("" UCX's default): a
  // rail's channel, its rail's NIC only (docs/operations.md, "Rails").
  std::string net_devices;
  // Bytes unpacked and checksummed at a time (cache-sized), as in tcp.
  int64_t segment_bytes = 256 << 10;
  // As TcpChannelOptions::connection_token: the connecting side writes it
  // first on the TCP connection, the accepting side compares it.
  std::string connection_token;
  // The meeting connection's socket options (it carries a few hundred
  // bytes).
  TcpSocketOptions socket = TcpSocketOptions{0};
};

class UcxListener : public ChannelListener {
 public:
  // The UCP worker address the next accepted channel receives on: what
  // ConnectUcxChannel needs, handed to the sender over an authenticated
  // channel. Changes after each Accept that returned a channel.
  virtual const std::string& worker_address() const = 0;
};

// Binds host:port (0: ephemeral; port() reports it) for ucx channels.
absl::StatusOr<std::unique_ptr<UcxListener>> ListenUcx(
    const std::string& host, int port, const UcxChannelOptions& options = {});

// Connects to a ListenUcx listener whose worker_address() is
// `worker_address` (1 byte to 64 KiB, else INVALID_ARGUMENT before any
// connection). UNAVAILABLE when nobody listens there, or the two ends share
// no transport (UCX's "Destination is unreachable"). A listener that
// refuses the token closes the meeting connection: the channel's sends
// fail UNAVAILABLE once they need the peer.
absl::StatusOr<std::unique_ptr<Channel>> ConnectUcxChannel(
    const std::string& host, int port, const std::string& worker_address,
    absl::Time deadline, const UcxChannelOptions& options = {});

// OK when this machine has the UCX transports named (UCX_TLS syntax; ""
// UCX's default): ferryd checks its --ucx_transports at start with it.
absl::Status CheckUcxTransports(const std::string& transports);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_UCX_UCX_CHANNEL_H_
