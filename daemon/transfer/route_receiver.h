// RouteReceiver: the receiving side of the data path between daemons
// ("Several nodes", docs/architecture.md): the channels peers open into
// this daemon, and the parts of a transfer a peer asks of this node.
//
// OpenChannel: a host channel ("tcp", "ucx") listens on an ephemeral port
// (ChannelFactory::Listen) and returns a connection token that the sender
// writes first on the connection; a fabric channel ("nccl") starts
// joining the sender's communicator as rank 1 on a thread of its own
// (joining blocks until both have). One entry per channel id and epoch; a
// higher epoch replaces a lower one.
//
// RunTransfer, by role: "receive" (the default) accepts the channel (once
// per epoch) and Receives every bucket into the memory and staging of
// ranks registered here (RouteMemory), or on the coordinator into the
// destination ranks its RouteSender expects; "send" sends from sources
// registered here to a peer node (RouteSender::SendRoute); "local" copies
// between them on this node (CopyRouter). Both first quantize what the
// request orders (FP8 in flight, route_quantizers.h).
//
// Owner: the Server. Threading: thread-safe (one mutex for the channel
// map); OpenChannel and RunTransfer run on gRPC threads; each channel is
// used by one call at a time.
#ifndef FERRY_DAEMON_TRANSFER_ROUTE_RECEIVER_H_
#define FERRY_DAEMON_TRANSFER_ROUTE_RECEIVER_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "daemon/memory/memory_map.h"
#include "daemon/transfer/copy_router.h"
#include "daemon/transfer/route_memory.h"
#include "daemon/transfer/route_quantizers.h"
#include "daemon/transfer/route_options.h"
#include "daemon/transfer/route_sender.h"
#include "proto/ferry/v1/peer.pb.h"
#include "transport/channel_factory.h"
#include "transport/transport.h"

namespace ferry {

class RouteReceiver {
 public:
  // `memory` holds what routes land in and send from here; `sender` sends
  // role "send"'s routes. Neither is owned.
  RouteReceiver(RouteOptions options, RouteMemory* memory,
                RouteSender* sender);
  ~RouteReceiver();
  RouteReceiver(const RouteReceiver&) = delete;
  RouteReceiver& operator=(const RouteReceiver&) = delete;

  // Peer.OpenChannel and Peer.RunTransfer.
  absl::Status OpenChannel(const v1::OpenChannelRequest& request,
                           v1::OpenChannelResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RunTransfer(const v1::RunTransferRequest& request,
                           const std::function<bool()>& cancelled,
                           v1::RunTransferResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Peer.BlockAmax (FP8 in flight, a split tensor's parts here:
  // RouteQuantizers::BlockAmax).
  absl::StatusOr<v1::BlockAmaxResponse> BlockAmax(
      const v1::BlockAmaxRequest& request);

  // Memory of a participant registered through this daemon, or null
  // (Peer.HashBoxes reads it; RouteMemory::LocalMemory).
  std::shared_ptr<const MemoryMap> LocalMemory(
      const std::string& participant_id);

 private:
  // How long the two daemons of a fabric channel have to join it.
  static constexpr absl::Duration kFabricJoinTimeout = absl::Seconds(60);

  // The receiver's side of a fabric channel being joined (OpenChannel
  // starts it; RunReceive waits for it).
  struct FabricJoin {
    absl::Notification done;
    absl::StatusOr<std::unique_ptr<Channel>> channel;
    std::thread thread;  // joined by the destructor
  };
  struct Incoming {
    int64_t epoch = 0;
    std::string token;
    std::unique_ptr<ChannelListener> listener;
    std::shared_ptr<FabricJoin> fabric;  // until RunReceive takes it
    std::unique_ptr<Channel> channel;  // once accepted / joined
  };

  // The channel's entry at the request's epoch, emptied of the lower
  // epoch's; FAILED_PRECONDITION unless the epoch is higher.
  absl::StatusOr<Incoming*> NewEpochLocked(const v1::OpenChannelRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OpenChannel of a host kind: listens for the sender's connection.
  absl::Status OpenHost(const v1::OpenChannelRequest& request,
                        v1::OpenChannelResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  // OpenChannel of a fabric: starts joining as rank 1.
  absl::Status OpenFabric(const v1::OpenChannelRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RunReceive(const v1::RunTransferRequest& request,
                          const std::function<bool()>& cancelled,
                          v1::RunTransferResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Roles "send" and "local": the request's quantize order carried out
  // (RouteQuantizers::Prepare) before its sources are read.
  absl::Status Quantize(const v1::RunTransferRequest& request);
  absl::Status RunSend(const v1::RunTransferRequest& request,
                       const std::function<bool()>& cancelled,
                       v1::RunTransferResponse* response);
  absl::Status RunLocal(const v1::RunTransferRequest& request,
                        const std::function<bool()>& cancelled,
                        v1::RunTransferResponse* response);
  // RunReceive's channel when none is kept at this epoch: the fabric
  // OpenChannel began joining, else the listener's next connection that
  // brings the token.
  absl::StatusOr<std::unique_ptr<Channel>> ReceivingChannel(
      const v1::RunTransferRequest& request, absl::Time deadline,
      ChannelListener* listener, FabricJoin* fabric);
  absl::Time DeadlineOf(const v1::RunTransferRequest& request) const;

  const RouteOptions options_;
  RouteMemory* const memory_;
  RouteSender* const sender_;
  RouteQuantizers quantizers_;  // FP8 in flight: roles "send" and "local"
  const CopyRouter router_;
  const ChannelFactory factory_;
  absl::Mutex mu_;
  std::map<std::string, Incoming> incoming_ ABSL_GUARDED_BY(mu_);  // by id
  std::vector<std::shared_ptr<FabricJoin>> joins_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_ROUTE_RECEIVER_H_
