// PeerService: the ferry.v1.Peer gRPC service (peer.proto), the membership
// half of "Several nodes" (docs/architecture.md).
//
// On the coordinator it holds the members: JoinCoordinator hands out a
// token and a lease, PeerHeartbeat renews it, LeaveCoordinator (or a lease
// that runs out) removes the member. Every join and leave bumps the
// membership epoch. The coordinator lists itself first among the members,
// so a member learns the coordinator's node name from JoinCoordinator. A
// member that lost its lease stays listed in Health() as unreachable (with
// a problem line) until it joins again.
//
// On a member daemon every membership call is FAILED_PRECONDITION naming
// the coordinator.
//
// Who may call (docs/api.md, "Authentication"): only peer daemons, over
// mutual TLS; a call on the unix socket is PERMISSION_DENIED. A caller acts
// only as the node its certificate names: it joins, heartbeats, leaves,
// forwards and opens channels as that node and no other, so one member
// cannot take over another's name. RunTransfer's "send" and "local" roles,
// which make a daemon connect out and copy, are taken only from the
// coordinator this daemon joined; its "receive" role only from a member
// (on the coordinator) or a peer of the cluster (on a member). ForwardRegistration (coordinator) parses a member's
// registration without mapping memory and adds it to the Registry.
// OpenChannel and RunTransfer (any daemon) are RouteReceiver's.
//
// Owner: the Server. Threading: thread-safe (one absl::Mutex); one thread
// of its own (Start/Stop) expires leases.
#ifndef FERRY_DAEMON_CLUSTER_PEER_SERVICE_H_
#define FERRY_DAEMON_CLUSTER_PEER_SERVICE_H_

#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/peer.grpc.pb.h"

namespace ferry {

class Registry;
class MemberMemory;
class RouteReceiver;

class PeerService final : public v1::Peer::Service {
 public:
  struct Options {
    std::string node;            // this daemon's node name
    // Empty: this daemon is the coordinator. Else the coordinator's
    // "host:port" (this daemon is a member; MemberLink joins it).
    std::string coordinator_address;
    absl::Duration lease = absl::Seconds(10);  // members' lease
    absl::Duration sweep_interval = absl::Milliseconds(100);
  };

  explicit PeerService(const Options& options);
  ~PeerService() override;  // Stop()
  PeerService(const PeerService&) = delete;
  PeerService& operator=(const PeerService&) = delete;

  void Start();  // the lease sweeper
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);   // idempotent

  // Set once, before Start (the address is known after binding).
  void set_peer_address(const std::string& address) {
    absl::MutexLock lock(&mu_);
    peer_address_ = address;
  }

  // Wiring, before Start. Coordinator: the Registry that forwarded
  // registrations join, and what to do with a member's participants when
  // it is lost, leaves or rejoins with replace_existing. Every daemon: the
  // data path (OpenChannel, RunTransfer).
  void set_registry(Registry* registry) { registry_ = registry; }
  void set_on_member_gone(
      std::function<void(const std::string& node, const std::string& why)>
          f) {
    on_member_gone_ = std::move(f);
  }
  void set_transfers(RouteReceiver* transfers) { transfers_ = transfers; }
  // Member: what offload and onload do to the ranks it maps
  // (ManageMemory; not owned).
  void set_member_memory(MemberMemory* memory) { member_memory_ = memory; }
  // Member: the node name of the coordinator it joined ("" until joined);
  // only that node may hand it send and local work.
  void set_coordinator_node(std::function<std::string()> f) {
    coordinator_node_ = std::move(f);
  }
  // A live member's peer address ("" if none).
  std::string AddressOf(const std::string& node) const ABSL_LOCKS_EXCLUDED(mu_);

  bool is_coordinator() const { return options_.coordinator_address.empty(); }

  grpc::Status JoinCoordinator(grpc::ServerContext* context,
                               const v1::JoinCoordinatorRequest* request,
                               v1::JoinCoordinatorResponse* response) override
      ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status LeaveCoordinator(grpc::ServerContext* context,
                                const v1::LeaveCoordinatorRequest* request,
                                v1::LeaveCoordinatorResponse* response) override
      ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status PeerHeartbeat(grpc::ServerContext* context,
                             const v1::PeerHeartbeatRequest* request,
                             v1::PeerHeartbeatResponse* response) override
      ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status OpenChannel(grpc::ServerContext* context,
                           const v1::OpenChannelRequest* request,
                           v1::OpenChannelResponse* response) override
      ABSL_LOCKS_EXCLUDED(mu_);

  grpc::Status ForwardRegistration(
      grpc::ServerContext* context,
      const v1::ForwardRegistrationRequest* request,
      v1::ForwardRegistrationResponse* response) override
      ABSL_LOCKS_EXCLUDED(mu_);
  grpc::Status RunTransfer(grpc::ServerContext* context,
                           const v1::RunTransferRequest* request,
                           v1::RunTransferResponse* response) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // Checksums of boxes in memory registered through this daemon
  // (transfer_checksums.h).
  grpc::Status HashBoxes(grpc::ServerContext* context,
                         const v1::HashBoxesRequest* request,
                         v1::HashBoxesResponse* response) override;
  // FP8 in flight's split tensors (RouteReceiver::BlockAmax). Like
  // HashBoxes, only from the joined coordinator.
  grpc::Status BlockAmax(grpc::ServerContext* context,
                         const v1::BlockAmaxRequest* request,
                         v1::BlockAmaxResponse* response) override;
  // Offload and onload of ranks registered through this daemon
  // (member_memory.h). Like HashBoxes, only from the joined coordinator.
  grpc::Status ManageMemory(grpc::ServerContext* context,
                            const v1::ManageMemoryRequest* request,
                            v1::ManageMemoryResponse* response) override;

  // Coordinator: every member but itself (joined and lost), for GetHealth,
  // and one problem line per lost member.
  void FillHealth(v1::GetHealthResponse* response) const
      ABSL_LOCKS_EXCLUDED(mu_);
  int64_t membership_epoch() const ABSL_LOCKS_EXCLUDED(mu_);
  // Expires leases now (the sweeper's step; tests may call it).
  void ExpireLeases() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // OK when the caller (mutual TLS) is the coordinator this member joined;
  // else PERMISSION_DENIED naming `rpc` and the caller. UNAVAILABLE first
  // when what the call needs (`needs`: the data path, member memory) is
  // null on this daemon.
  absl::Status FromJoinedCoordinator(const grpc::ServerContext& context,
                                     const char* rpc, const void* needs) const;
  struct Member {
    v1::PeerMember info;
    std::string token;
    absl::Time last_heartbeat;
    bool lost = false;  // lease ran out; kept for GetHealth until rejoin
    absl::Time lost_at;
  };

  grpc::Status NotCoordinator() const;
  // The certificate identity of a peer daemon's call; PERMISSION_DENIED
  // on the unix socket (or without a certificate).
  static absl::StatusOr<std::string> PeerIdentity(
      const grpc::ServerContext& context);
  // PERMISSION_DENIED unless `claimed` is the caller's identity.
  static grpc::Status ActsAs(const grpc::ServerContext& context,
                             const std::string& claimed, const char* field);
  // The members list of responses: the coordinator, then the live members.
  void ListMembersLocked(
      google::protobuf::RepeatedPtrField<v1::PeerMember>* out) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  grpc::Status AuthenticateLocked(const v1::PeerHandle& handle,
                                  Member** member)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void SweepLoop() ABSL_LOCKS_EXCLUDED(mu_);

  const Options options_;
  Registry* registry_ = nullptr;
  RouteReceiver* transfers_ = nullptr;
  MemberMemory* member_memory_ = nullptr;
  std::function<void(const std::string&, const std::string&)> on_member_gone_;
  std::function<std::string()> coordinator_node_;
  const absl::Time started_ = absl::Now();

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  std::map<std::string, Member> members_ ABSL_GUARDED_BY(mu_);  // by node
  std::string peer_address_ ABSL_GUARDED_BY(mu_);  // this daemon's
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_token_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread sweeper_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_PEER_SERVICE_H_
