// gRPC channels to peer daemons, one per address, kept between calls.
//
// Why: a channel made for one call opens its own TCP connection and runs a
// TLS handshake before the call, and a version between two nodes makes at
// least one call per route (Peer.RunTransfer). Measured on loopback, a
// version of an 8 MiB model between two daemons took 16-20 ms with a channel
// per call (docs/benchmarks.md); the bytes take under 3 ms.
//
// A kept channel to a daemon that restarted reconnects by itself; its
// reconnect backoff is capped at 1 s (gRPC's default grows to 120 s), so a
// restarted peer is reachable again within a second, as it was when every
// call dialled afresh (multi_node_e2e_test: "kill -9 of member C
// mid-version ...; restarted, the next version commits").
//
// A connection attempt that fails or times out (a peer starved of CPU, a
// restart) is not a failed version: Connected() waits through gRPC's own
// retries, up to kConnectBudget within the caller's deadline, before a
// route's first call.
//
// Thread-safe.
#ifndef FERRY_DAEMON_TRANSFER_PEER_CHANNELS_H_
#define FERRY_DAEMON_TRANSFER_PEER_CHANNELS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>

#include <grpcpp/grpcpp.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "absl/synchronization/mutex.h"

namespace ferry {

class PeerChannels {
 public:
  explicit PeerChannels(std::shared_ptr<grpc::ChannelCredentials> credentials);

  // The channel to `address` ("host:port"), made at the first call.
  std::shared_ptr<grpc::Channel> For(const std::string& address)
      ABSL_LOCKS_EXCLUDED(mu_);

  // OK once the channel to `address` (node `node`'s) is connected, within
  // min(deadline, now + kConnectBudget); UNAVAILABLE naming the node if
  // no attempt succeeded by then; CANCELLED once `cancelled` (may be
  // empty) says so.
  absl::Status Connected(const std::string& node, const std::string& address,
                         absl::Time deadline,
                         const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);

  // As long as a peer's default lease (ferryd --peer_lease_ms): a peer
  // unreachable for longer is given up by the coordinator anyway.
  static constexpr absl::Duration kConnectBudget = absl::Seconds(10);

 private:
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_PEER_CHANNELS_H_
