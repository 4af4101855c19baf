// RouteOptions: how this daemon's data path between daemons is set up,
// one struct for its three parts (RouteMemory, RouteSender,
// RouteReceiver; the Server fills it from the DaemonOptions).
//
// Owner: each part keeps its own copy. Threading: plain data.
#ifndef FERRY_DAEMON_TRANSFER_ROUTE_OPTIONS_H_
#define FERRY_DAEMON_TRANSFER_ROUTE_OPTIONS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/limits.h"
#include "daemon/metrics/daemon_metrics.h"
#include "grpcpp/security/credentials.h"
#include "transport/channel_factory.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace ferry {

struct RouteOptions {
  std::string node;       // this daemon's node
  std::string host;       // host other daemons reach this one at
  // The peer address of a live member (coordinator: PeerService).
  std::function<std::string(const std::string& node)> address_of;
  absl::Duration timeout = absl::Minutes(2);  // one instance's transfer
  // Same-node parts (RunTransfer role "local", the coordinator's own
  // boxes): the host engine and the node's GPUs; not owned.
  CopyEngine* engine = nullptr;
  DeviceMemory* devices = nullptr;
  // How this daemon proves itself to the others (mutual TLS), and the
  // host its channel listeners bind (--listen's; "" any).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string listen_host;
  // Staging the ranks of this node may hold together for fallback
  // tensors (--max_staging_mb, resolved): a member bounds its own, what
  // ever its coordinator asks; 0 refuses all staging, as the
  // coordinator's own limit does. Negative: no limit.
  int64_t max_staging_bytes = -1;
  // Counts channel opens (not owned; null: none).
  DaemonMetrics* metrics = nullptr;
  // Host channels to these nodes go over UCX (DaemonOptions::ucx_nodes:
  // "" none, "*" all, or node names), with these UCX transports (for
  // the channels this daemon opens and those it accepts).
  std::string ucx_nodes;
  std::string ucx_transports;
  // Rails (docs/operations.md, "Rails"; --rails resolved): the local
  // addresses, one per NIC, that TCP channels to and from other nodes
  // bind, at most Limits::kMaxRails. Empty: one rail, no binding
  // (listen_host, and `host` in what OpenChannel answers).
  std::vector<std::string> rails;
  // Each rail's interface, for UCX channels (UCX_NET_DEVICES); "" none.
  std::vector<std::string> rail_devices;
  // How long a TCP channel may go unanswered before it fails
  // (--channel_dead_after_ms; zero: the kernel's defaults).
  absl::Duration channel_dead_after = absl::ZeroDuration();
  // Delta versions (--delta_shadow_mb): host memory this daemon may keep of
  // its sources' buffers to send patches (delta_shadows.h); 0: off, every
  // bucket dense.
  int64_t delta_shadow_bytes = 0;
};

// What the ChannelFactory of the sender and of the receiver is told.
inline ChannelFactoryOptions ChannelFactoryOptionsOf(
    const RouteOptions& options) {
  ChannelFactoryOptions f;
  f.listen_host = options.listen_host;
  f.ucx_transports = options.ucx_transports;
  f.devices = options.devices;
  f.dead_after = options.channel_dead_after;
  return f;
}

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_ROUTE_OPTIONS_H_
