// RemoteTransfers: the cross-node data path of "Several nodes"
// (docs/architecture.md), first cut.
//
// Routes: the transfer worker splits an instance's buckets by (source
// node, destination node); an instance may be spread over several nodes
// (ranks on the coordinator's node: its CopyEngine and its own staging).
// A route whose sources are on the coordinator's node is sent by the
// coordinator (below); one whose sources are on a member is handed to that
// member (RunTransfer role "send": it sends on its own channel to the
// destination's node, as below; role "local" when the destination ranks
// are on the same member: its CopyEngine copies).
//
// Sender (the coordinator, or a member asked to send): for an instance
// whose ranks are on another node, the VersionCoordinator's transfer worker
// calls Execute. It opens (once, kept across versions, replaced with a
// higher epoch after any error) a TcpChannel to that node with
// Peer.OpenChannel, asks the node for its part with Peer.RunTransfer (the
// instance's buckets as flat strided descriptors of destination memory),
// then packs and Sends the buckets in plan order from mapped source memory.
// Execute returns once the receiver's RunTransfer returned (every byte
// unpacked and checksummed) or either end failed.
//
// Receiver (a member daemon): OpenChannel listens on an ephemeral port and
// returns a connection token that the sender writes first on the
// connection (TcpChannelOptions::connection_token); RunTransfer accepts the
// connection (once per channel epoch) and Receives every bucket into the
// memory of participants registered through this daemon (AddLocal).
//
// Fallback tensors land in staging reserved on the destination's node (per
// participant, kept across versions); Execute returns each rank's APPLY
// detail naming it (TransferJob::apply).
//
// A route from a member's sources to destination ranks on the coordinator's
// node: the member sends (role "send", peer = the coordinator) and the
// coordinator receives it as above, on its own Peer service, unpacking into
// the destination memory and staging it mapped (TransferJob::destination,
// registered for the duration of Execute; no staging needs on the wire).
//
// Same-node parts go through CopyRouter (host memcpy or a GPU's kernels).
// A route between nodes with any box of GPU memory travels over NCCL
// instead of TCP (RunTransferRequest.nccl): the sender makes a communicator
// id (DeviceMemory::NewFabricId), OpenChannel hands it to the receiver with
// the receiver's GPU, and both join a two-rank communicator on one GPU each
// (the receiver on a thread of its own, since joining blocks until both
// have); the NCCL channel then packs and unpacks with the GPUs' kernels.
// Host boxes of such a route are pinned for the GPU on their side. The
// channel is kept per (node, transport) and epoch like a TCP one.
//
// Files: the routes are built by transfer_routes.h (pure); the sending side
// (Execute, channels out, SendRoute) is remote_transfers.cc, the receiving
// side (OpenChannel, RunTransfer's roles) remote_receiver.cc.
//
// Owner: the Server. Threading: thread-safe (one mutex for the maps);
// Execute runs on the transfer worker, RunTransfer on a gRPC thread; each
// channel is used by one call at a time.
#ifndef FERRY_DAEMON_TRANSFER_REMOTE_TRANSFERS_H_
#define FERRY_DAEMON_TRANSFER_REMOTE_TRANSFERS_H_

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "daemon/memory/memory_map.h"
#include "daemon/memory/staging_area.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/transfer/copy_router.h"
#include "daemon/transfer/local_executor.h"
#include "daemon/transfer/peer_channels.h"
#include "daemon/transfer/transfer_routes.h"
#include "grpcpp/security/credentials.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace ferry {

// True when `ucx_nodes` ("" none, "*" all, or comma-separated node names;
// DaemonOptions::ucx_nodes) covers `node`.
bool UcxCovers(const std::string& ucx_nodes, const std::string& node);

class RemoteTransfers : public RemoteExecutor {
 public:
  struct Options {
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
  };

  explicit RemoteTransfers(Options options);
  ~RemoteTransfers() override;

  // Member: memory of a participant registered through this daemon.
  void AddLocal(const std::string& participant_id,
                std::shared_ptr<const MemoryMap> memory)
      ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveLocal(const std::string& participant_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Member: that memory, or null (Peer.HashBoxes reads it).
  std::shared_ptr<const MemoryMap> LocalMemory(
      const std::string& participant_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Staging this daemon holds for ranks it maps as a member (RunTransfer's
  // receiving side), bytes: the /metrics staging gauge of a member.
  int64_t StagingBytesInUse() ABSL_LOCKS_EXCLUDED(mu_);

  // Drops the channel to `node` (its daemon was lost, left or restarted);
  // the next transfer opens one with a higher epoch.
  void ForgetNode(const std::string& node) ABSL_LOCKS_EXCLUDED(mu_);

  // RemoteExecutor (sender side).
  bool Handles(const TransferJob& job) const override;
  absl::Status Execute(const TransferJob& job) override
      ABSL_LOCKS_EXCLUDED(mu_);

  // Peer service (receiver side).
  absl::Status OpenChannel(const v1::OpenChannelRequest& request,
                           v1::OpenChannelResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RunTransfer(const v1::RunTransferRequest& request,
                           const std::function<bool()>& cancelled,
                           v1::RunTransferResponse* response);

 private:
  // How long the two daemons of an NCCL channel have to join it.
  static constexpr absl::Duration kFabricJoinTimeout = absl::Seconds(60);

  struct Outgoing {
    int64_t epoch = 0;
    std::unique_ptr<Channel> channel;
    // A route is being sent on it: routes to one node take turns (a
    // channel has one owner), routes to other nodes run at once.
    bool in_use = false;
  };
  // The receiver's side of an NCCL channel being joined (OpenChannel
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
    std::shared_ptr<FabricJoin> fabric;  // NCCL, until RunReceive takes it
    std::unique_ptr<Channel> channel;  // once accepted / joined
  };

  // Staging slot k, by participant id.
  using StagingBases = std::map<std::string, std::map<int32_t, BufferPlace>>;
  // The memory a part's views point into (participants' maps, staging),
  // held until the part is done: a participant that deregisters meanwhile
  // (an engine exiting after its commit while a replica relays from it)
  // must not have its memory unmapped under a copy.
  using KeepAlive = std::vector<std::shared_ptr<const void>>;

  // The channel's entry at the request's epoch, emptied of the lower
  // epoch's; FAILED_PRECONDITION unless the epoch is higher.
  absl::StatusOr<Incoming*> NewEpochLocked(const v1::OpenChannelRequest& request)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // OpenChannel with an NCCL setup: starts joining as rank 1.
  absl::Status OpenFabric(const v1::OpenChannelRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RunReceive(const v1::RunTransferRequest& request,
                          const std::function<bool()>& cancelled,
                          v1::RunTransferResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RunSend(const v1::RunTransferRequest& request,
                       const std::function<bool()>& cancelled,
                       v1::RunTransferResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status RunLocal(const v1::RunTransferRequest& request,
                        const std::function<bool()>& cancelled,
                        v1::RunTransferResponse* response)
      ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status ReserveStagingLocked(const v1::RunTransferRequest& request,
                                    v1::RunTransferResponse* response,
                                    StagingBases* staging_bases,
                                    KeepAlive* keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The buckets as views of memory mapped here, and where each box is.
  // UNIMPLEMENTED for GPU memory unless `gpu_ok` (same-node parts).
  absl::Status ViewsLocked(
      const google::protobuf::RepeatedPtrField<v1::TransferBucket>& buckets,
      const StagingBases& staging_bases, bool gpu_ok,
      std::vector<BucketView>* views, Places* places, KeepAlive* keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends `views` on this node's channel to `node` while `node` receives
  // its part `req` (RunTransfer role "receive").
  absl::Status SendRoute(const std::string& node, const std::string& address,
                         v1::RunTransferRequest req,
                         const std::vector<BucketView>& views,
                         absl::Time deadline,
                         const std::function<bool()>& cancelled,
                         const std::function<void(int64_t)>& on_bytes,
                         v1::RunTransferResponse* resp)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Copies box j of from[i] into box j of to[i], each with the engine
  // CopyRouter picks for its places; returns the bytes copied.
  absl::StatusOr<int64_t> CopyHere(const std::vector<BucketView>& from,
                                   Places& from_places,
                                   const std::vector<BucketView>& to,
                                   Places& to_places,
                                   const std::function<bool()>& cancelled,
                                   const std::function<void(int64_t)>& on_bytes);
  // Peer.RunTransfer on `node`, cancelled when `cancelled` turns true.
  absl::Status CallRunTransfer(const std::string& node,
                               const std::string& address,
                               const v1::RunTransferRequest& req,
                               absl::Time deadline,
                               const std::function<bool()>& cancelled,
                               v1::RunTransferResponse* resp);

  // "nccl" for a route with `nccl` set, else "ucx" or "tcp" as
  // Options::ucx_nodes says for `node`.
  std::string ChannelTransport(const std::string& node,
                               const v1::NcclRoute* nccl) const;
  // Opens this node's channel to `node` at `epoch`: the transport
  // ChannelTransport names.
  absl::StatusOr<std::unique_ptr<Channel>> Connect(
      const std::string& node, const std::string& address,
      const std::string& channel_id, int64_t epoch,
      const v1::NcclRoute* nccl, absl::Time deadline);
  // Pins the host places among `places` for the GPUs (an NCCL route's
  // boxes on this side); UNIMPLEMENTED for staging that is not pinned.
  absl::Status PinForFabric(Places& places) const;

  const Options options_;
  PeerChannels peers_;  // Peer RPCs to other daemons, a channel per address
  const CopyRouter router_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const MemoryMap>> local_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, Outgoing> outgoing_ ABSL_GUARDED_BY(mu_);  // by node
  std::map<std::string, Incoming> incoming_ ABSL_GUARDED_BY(mu_);  // by id
  // Member: staging for fallback tensors, by participant id.
  std::map<std::string, std::shared_ptr<StagingArea>> staging_
      ABSL_GUARDED_BY(mu_);
  // Coordinator: destination ranks on this node that a member's route is
  // being received into (during Execute), by participant id.
  std::map<std::string, RankMemory> receiving_ ABSL_GUARDED_BY(mu_);
  uint64_t next_bucket_ ABSL_GUARDED_BY(mu_) = 1;
  std::vector<std::shared_ptr<FabricJoin>> joins_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_REMOTE_TRANSFERS_H_
