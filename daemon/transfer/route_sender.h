// RouteSender: the sending side of the data path between daemons
// ("Several nodes", docs/architecture.md).
//
// Routes: the transfer worker splits an instance's buckets by (source
// node, destination node) (transfer_routes.h); an instance may be spread
// over several nodes (ranks on the coordinator's node: its CopyEngine and
// its own staging). A route whose sources are on the coordinator's node is
// sent by the coordinator (below); one whose sources are on a member is
// handed to that member (RunTransfer role "send": it sends on its own
// channel to the destination's node, as below; role "local" when the
// destination ranks are on the same member: its CopyEngine copies).
//
// Sending (the coordinator, or a member asked to send): for an instance
// whose ranks are on another node, the VersionCoordinator's transfer
// worker calls Execute. It opens (once, kept across versions, replaced
// with a higher epoch after any error) a channel to that node with
// Peer.OpenChannel, asks the node for its part with Peer.RunTransfer (the
// instance's buckets as flat strided descriptors of destination memory),
// then packs and Sends the buckets in plan order from mapped source
// memory. Execute returns once the receiver's RunTransfer returned (every
// byte unpacked and checksummed) or either end failed. Fallback tensors
// land in staging reserved on the destination's node; Execute returns
// each rank's APPLY detail naming it (TransferJob::apply).
//
// A route from a member's sources to destination ranks on the
// coordinator's node: the member sends (role "send", peer = the
// coordinator) and the coordinator receives it (RouteReceiver) into the
// destination memory and staging it mapped, expected in RouteMemory for
// the duration of Execute.
//
// Channels (outgoing_channels.h) by kind: a route with any box of GPU
// memory goes over the GPUs' fabric ("nccl": the sender makes the
// communicator id, OpenChannel hands it to the receiver with the
// receiver's GPU, both join a two-rank communicator on one GPU each),
// host routes over "ucx" to the nodes --ucx_nodes names and "tcp" to the
// others, a TCP route striped over a channel per rail pair
// (rail_stripe.h). Host boxes of a fabric route are pinned for the GPU on
// their side. Channels are kept per (node, fabric or host, rail) and
// epoch.
//
// Owner: the Server. Threading: thread-safe (one mutex for the bucket
// counter; the channels have their own); Execute runs on transfer workers, SendRoute also on gRPC threads
// (RouteReceiver's role "send"); each channel is used by one route at a
// time.
#ifndef FERRY_DAEMON_TRANSFER_ROUTE_SENDER_H_
#define FERRY_DAEMON_TRANSFER_ROUTE_SENDER_H_

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
#include "daemon/transfer/copy_router.h"
#include "daemon/transfer/delta_shadows.h"
#include "daemon/transfer/outgoing_channels.h"
#include "daemon/transfer/peer_channels.h"
#include "daemon/transfer/route_calls.h"
#include "daemon/transfer/route_memory.h"
#include "daemon/transfer/route_options.h"
#include "daemon/transfer/transfer_executor.h"
#include "daemon/transfer/transfer_job.h"
#include "daemon/transfer/transfer_routes.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "transport/channel_factory.h"
#include "transport/transport.h"

namespace ferry {

class RouteSender : public RemoteExecutor {
 public:
  // `memory` (not owned) is where Execute expects the routes a member
  // sends to this node.
  RouteSender(RouteOptions options, RouteMemory* memory);
  RouteSender(const RouteSender&) = delete;
  RouteSender& operator=(const RouteSender&) = delete;

  // Drops the channels to `node` (its daemon was lost, left or
  // restarted); the next transfer opens one with a higher epoch.
  void ForgetNode(const std::string& node) { channels_.ForgetNode(node); }

  // RemoteExecutor.
  bool Handles(const TransferJob& job) const override;
  absl::Status Execute(const TransferJob& job) override
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<std::vector<std::vector<uint32_t>>> PartialAmax(
      const TransferJob& job, const std::string& node,
      const std::vector<size_t>& tensors) override;

  // Sends `views` (their boxes' buffers: `places`, for patches) on this
  // node's channels to `node` while `node` receives its part `req`
  // (RunTransfer role "receive"). A kept channel that fails is replaced
  // once and the route sent again. With shadows (delta versions), each
  // bucket goes as delta_routes.h says; `resp` then holds the receiver's
  // counts.
  absl::Status SendRoute(const std::string& node, const std::string& address,
                         v1::RunTransferRequest req,
                         const std::vector<BucketView>& views,
                         const Places& places, absl::Time deadline,
                         const std::function<bool()>& cancelled,
                         const std::function<void(int64_t)>& on_bytes,
                         v1::RunTransferResponse* resp)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One try of SendRoute on its channels.
  struct Attempt {
    absl::Status sent;      // this side's Sends and Flush
    absl::Status received;  // the receiver's RunTransfer
    int64_t sent_bytes = 0;
    // Why the try failed. A receiver that refuses the route (its staging
    // limit, a region gone) answers and closes the channel, and this side
    // may see the closed socket first: then the answer is the cause and
    // the broken socket only its effect.
    absl::Status Cause() const;
  };
  // How long a sender whose channel the receiver closed waits for the
  // receiver's answer, which says why, before it gives up on it (the
  // receiver may be gone for good).
  static constexpr absl::Duration kAnswerAfterCloseWait = absl::Seconds(2);
  using Addresses = std::map<std::string, std::string>;  // by node

  // Execute's steps: the peer addresses of every node a route involves
  // (UNAVAILABLE for one that is not a live member); every route at once,
  // the staging their receivers reserved into `staging`; one route.
  absl::StatusOr<Addresses> AddressesOf(const std::vector<RouteKey>& order)
      const;
  absl::Status RunRoutes(NodeRoutes& routes, const Addresses& addresses,
                         absl::Time deadline, TransferProgress& progress,
                         std::map<std::string, v1::ParticipantStaging>* staging)
      ABSL_LOCKS_EXCLUDED(mu_);
  // A route this node sends (or copies, to its own staging).
  absl::Status RunRoute(const RouteKey& key, NodeRoute& route,
                        const Addresses& addresses, absl::Time deadline,
                        const std::function<bool()>& give_up,
                        TransferProgress& progress,
                        v1::RunTransferResponse* resp) ABSL_LOCKS_EXCLUDED(mu_);
  // A route another node carries: its RunTransfer started on `calls`.
  absl::Status AskRoute(const RouteKey& key, NodeRoute& route,
                        const Addresses& addresses, absl::Time deadline,
                        const std::function<bool()>& give_up,
                        RouteCalls& calls, size_t index);

  Attempt SendOnce(const std::string& node, const std::string& address,
                   const v1::RunTransferRequest& req,
                   const std::vector<BucketView>& views, const Places& places,
                   absl::Time deadline,
                   const std::function<bool()>& cancelled,
                   const std::function<void(int64_t)>& on_bytes,
                   RouteChannels& channels, v1::RunTransferResponse* resp);

  const RouteOptions options_;
  RouteMemory* const memory_;
  PeerChannels peers_;  // Peer RPCs to other daemons, a channel per address
  const CopyRouter router_;
  OutgoingChannels channels_;  // to other nodes, kept across versions
  DeltaShadows shadows_;       // of the sources routes read here
  absl::Mutex mu_;
  uint64_t next_bucket_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_ROUTE_SENDER_H_
