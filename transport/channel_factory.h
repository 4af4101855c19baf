// ChannelFactory: the one place that names the backends of the channels
// between daemons. The daemon asks for a channel by kind and passes what
// it knows (the host to bind, the connection token, the UCX transports,
// the node's GPUs); the factory maps that onto each backend's options.
//
// Kinds, by name (the names the daemon logs and counts, and the wire's
// OpenChannel oneof):
//   "tcp"   host memory over one TCP connection (transport/tcp).
//   "ucx"   host memory over UCX (transport/ucx); the listener also hands
//           out its UCP worker address (ChannelOffer::worker_address).
//   "nccl"  GPU memory over a two-rank communicator of the node's GPUs
//           (DeviceMemory's fabric; cuda/ implements it): the sending
//           daemon makes an id (OfferFabric), both join it (JoinFabric),
//           rank 0 sends, rank 1 receives.
// The host kinds ("tcp", "ucx") have a listening end (Listen) and a
// connecting end (Connect); "nccl" has neither.
//
// Owner: whoever opens channels (the daemon's route sender and receiver),
// one each. Threading: const and stateless past construction; any thread.
// The channels and listeners it returns follow transport.h.
#ifndef FERRY_TRANSPORT_CHANNEL_FACTORY_H_
#define FERRY_TRANSPORT_CHANNEL_FACTORY_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace ferry {

struct ChannelFactoryOptions {
  // The host listeners bind ("" every address).
  std::string listen_host;
  // UCX_TLS of this daemon's "ucx" channels, listening and connecting
  // ("" UCX's default, or UCX_TLS from the environment).
  std::string ucx_transports;
  // The node's GPUs, for "nccl" (not owned; null: none).
  DeviceMemory* devices = nullptr;
  // "tcp": how long a connection may go unanswered before it fails
  // (TcpSocketOptions::dead_after; zero: the kernel's defaults).
  absl::Duration dead_after = absl::ZeroDuration();
};

// What a listening end hands the connecting end besides its host (over an
// authenticated call: Peer.OpenChannel).
struct ChannelOffer {
  int port = 0;
  // "ucx": the UCP worker address the accepted channel receives on.
  std::string worker_address;
};

class ChannelFactory {
 public:
  explicit ChannelFactory(ChannelFactoryOptions options);

  // Whether `kind` is "tcp" or "ucx" (a listener and a connection).
  static bool IsHostKind(absl::string_view kind);

  // Listening end of a host kind: binds an ephemeral port of `host` (a
  // rail's address; "" listen_host; "ucx": its NIC `device` only, "" any);
  // the listener accepts connections that start with `token` (and refuses
  // others, PERMISSION_DENIED per Accept). Fills `offer`.
  // INVALID_ARGUMENT for a kind that is not a host kind; the backend's
  // error otherwise.
  absl::StatusOr<std::unique_ptr<ChannelListener>> Listen(
      absl::string_view kind, const std::string& token,
      const std::string& host, ChannelOffer* offer,
      const std::string& device = "") const;

  // Connecting end of a host kind: to `host` and what its Listen offered,
  // writing `token` first, leaving from `local_host` (a rail's address;
  // "" the kernel's choice); "ucx": over NIC `device` only ("" any). UNAVAILABLE when nobody listens
  // there.
  absl::StatusOr<std::unique_ptr<Channel>> Connect(
      absl::string_view kind, const std::string& host,
      const ChannelOffer& offer, const std::string& token,
      absl::Time deadline, const std::string& local_host = "",
      const std::string& device = "") const;

  // "nccl": a new communicator id, made by the sending daemon.
  // FAILED_PRECONDITION without GPUs.
  absl::StatusOr<std::string> OfferFabric() const;
  // "nccl": joins communicator `id` at `epoch` as `rank` on GPU `gpu`
  // (DeviceMemory::JoinFabric: blocks until both ranks joined or
  // `deadline`).
  absl::StatusOr<std::unique_ptr<Channel>> JoinFabric(
      int gpu, const std::string& id, int rank, int64_t epoch,
      absl::Time deadline) const;

 private:
  const ChannelFactoryOptions options_;
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_CHANNEL_FACTORY_H_
