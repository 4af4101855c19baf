// OutgoingChannels: the channels this daemon keeps to other nodes, by
// node, kind and rail; RouteSender sends a route on them.
//
// A route's channels to a node: one for a fabric ("nccl") route; for the
// host kinds (TCP, UCX), one per rail pair the two daemons share (this
// daemon's RouteOptions::rails and the count the receiver answers
// OpenChannel with; rail i connects from this node's rail i to the
// receiver's rail i, a UCX one over that rail's NIC only), the route's
// buckets striped over them (rail_stripe.h). Each is
// opened once (Peer.OpenChannel, then the factory's end of its kind),
// kept across versions, and replaced at a higher epoch after any error.
// Epochs start at the wall clock, so a restarted sender opens a higher
// epoch than the one a surviving receiver still holds.
//
// A rail whose channel cannot be opened (its link is down: the connection
// times out within kRailConnectBudget, or is refused) is left out for
// kRailRestAfterFailure and the route goes on the other rails; the route
// fails only when no rail opens. docs/operations.md, "Rails".
//
// Routes to one node and kind take turns (Claim): a channel has one owner.
//
// Owner: RouteSender. Threading: thread-safe (one mutex for the map).
#ifndef FERRY_DAEMON_TRANSFER_OUTGOING_CHANNELS_H_
#define FERRY_DAEMON_TRANSFER_OUTGOING_CHANNELS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/transfer/peer_channels.h"
#include "daemon/transfer/route_options.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "transport/channel_factory.h"
#include "transport/transport.h"

namespace ferry {

// True when `nodes` ("" none, "*" all, or comma-separated node names;
// DaemonOptions::ucx_nodes) covers `node`.
bool NodesCover(const std::string& nodes, const std::string& node);

// The channels one try of a route goes on, taken from OutgoingChannels.
struct RouteChannels {
  struct One {
    std::string key;         // in the kept map
    std::string channel_id;  // as the receiver knows it
    int64_t epoch = 0;
    int rail = 0;
    bool kept = false;  // kept from an earlier route (may be stale)
    std::unique_ptr<Channel> channel;
  };
  std::vector<One> channels;  // in stripe order: the first is channel_id

  bool any_kept() const;
  std::vector<Channel*> raw() const;
  // Names the channels in `req` (channel_id, channel_epoch,
  // rail_channels).
  void Describe(v1::RunTransferRequest* req) const;
};

class OutgoingChannels {
 public:
  // How long one rail's connection may take when there are several: a
  // link that is down must not hold the route until its deadline.
  static constexpr absl::Duration kRailConnectBudget = absl::Seconds(2);
  // How long a rail that would not open is left out before it is tried
  // again.
  static constexpr absl::Duration kRailRestAfterFailure = absl::Seconds(30);

  // `peers` (not owned) carries OpenChannel.
  OutgoingChannels(const RouteOptions& options, PeerChannels* peers);
  OutgoingChannels(const OutgoingChannels&) = delete;
  OutgoingChannels& operator=(const OutgoingChannels&) = delete;

  // The channel kind of a route to `node`: "nccl" when `req` carries a
  // fabric route, else "ucx" or "tcp" as RouteOptions::ucx_nodes says.
  std::string KindOf(const std::string& node,
                     const v1::RunTransferRequest& req) const;

  // Drops the channels to `node` (its daemon was lost, left or
  // restarted); the next route opens them at higher epochs.
  void ForgetNode(const std::string& node) ABSL_LOCKS_EXCLUDED(mu_);

  // Waits until no route holds the channels of `node` for `req`'s kind
  // and claims them (CANCELLED, DEADLINE_EXCEEDED). The claim ends when
  // the returned handle is destroyed.
  class Claim {
   public:
    Claim(OutgoingChannels* owner, std::string key)
        : owner_(owner), key_(std::move(key)) {}
    ~Claim();
    Claim(const Claim&) = delete;
    Claim& operator=(const Claim&) = delete;

   private:
    OutgoingChannels* const owner_;
    const std::string key_;
  };
  absl::StatusOr<std::unique_ptr<Claim>> ClaimFor(
      const std::string& node, const v1::RunTransferRequest& req,
      absl::Time deadline, const std::function<bool()>& cancelled)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The claimed channels of a route to `node` (at `address`): kept ones,
  // or opened at their next epochs. Error when none opens.
  absl::StatusOr<RouteChannels> Take(const std::string& node,
                                     const std::string& address,
                                     const v1::RunTransferRequest& req,
                                     absl::Time deadline)
      ABSL_LOCKS_EXCLUDED(mu_);
  // After a route succeeded on them: kept for the next (unless their
  // node was forgotten meanwhile). After a failure, drop them instead.
  void Keep(RouteChannels channels) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // How long the two daemons of a fabric channel have to join it.
  static constexpr absl::Duration kFabricJoinTimeout = absl::Seconds(60);

  struct Kept {
    int64_t epoch = 0;
    std::unique_ptr<Channel> channel;
    bool in_use = false;      // the node's first key: a route holds it
    int peer_rails = 0;       // the node's first key: 0 not yet known
    absl::Time rest_until = absl::InfinitePast();  // a rail left out
  };

  // One channel: the kept one at `key`, or a new one at the next epoch.
  absl::StatusOr<RouteChannels::One> TakeOne(
      const std::string& node, const std::string& address,
      const std::string& key, int rail, const v1::RunTransferRequest& req,
      absl::Time deadline) ABSL_LOCKS_EXCLUDED(mu_);
  // Opens channel `channel_id` to `node` at `epoch` on `rail`
  // (Peer.OpenChannel, then the factory's end of that kind); notes the
  // receiver's rail count in *peer_rails.
  absl::StatusOr<std::unique_ptr<Channel>> Connect(
      const std::string& node, const std::string& address,
      const std::string& channel_id, int64_t epoch, int rail,
      const v1::RunTransferRequest& route, absl::Time deadline,
      int* peer_rails);

  const RouteOptions options_;
  PeerChannels* const peers_;
  const ChannelFactory factory_;
  absl::Mutex mu_;
  // By node ("<node>#nccl" for fabric routes, "<node>/rail<i>" for TCP
  // rails past the first).
  std::map<std::string, Kept> kept_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_OUTGOING_CHANNELS_H_
