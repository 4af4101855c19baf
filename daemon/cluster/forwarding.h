// Forwarding: a member daemon's client-facing services (docs/architecture.md,
// "Several nodes": clients talk only to their own node's daemon).
//
// Registry: RegisterSource / RegisterDestination are parsed, validated and
// mapped here (the memory is on this node), then forwarded with
// Peer.ForwardRegistration; the handle the coordinator returns keys the
// mapped memory (RouteMemory::AddLocal). Heartbeat, Deregister, every
// Versions RPC (Subscribe forwarded event by event) and Inspection (but
// GetHealth, answered here) are forwarded verbatim to the coordinator over
// its TCP port. UNAVAILABLE while this daemon has not joined.
//
// The member watches its clients' pids (every 100 ms) and forwards a
// Deregister when one exits.
//
// Owner: the Server. Threading: gRPC's sync server calls it from many
// threads (Subscribe: its callback API); the stubs are thread-safe.
#ifndef FERRY_DAEMON_CLUSTER_FORWARDING_H_
#define FERRY_DAEMON_CLUSTER_FORWARDING_H_

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/cluster/call_batcher.h"
#include "daemon/cluster/member_link.h"
#include "daemon/cluster/subscription_relay.h"
#include "daemon/memory/member_memory.h"
#include "daemon/security/caller_identity.h"
#include "daemon/transfer/route_memory.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "proto/ferry/v1/registration.grpc.pb.h"
#include "proto/ferry/v1/version.grpc.pb.h"
#include "transport/device_memory.h"

namespace ferry {

struct ForwardingContext {
  std::string node;
  DeviceMemory* devices = nullptr;        // not owned; maps CUDA regions
  const CallerIdentity* callers = nullptr;  // not owned; who registers
  MemberLink* link = nullptr;             // not owned
  RouteMemory* route_memory = nullptr;    // not owned
  MemberMemory* memory = nullptr;         // not owned; offload's host copies
  std::shared_ptr<grpc::Channel> coordinator;
};

class ForwardingRegistryService final : public v1::Registry::Service {
 public:
  explicit ForwardingRegistryService(ForwardingContext context);
  ~ForwardingRegistryService() override;  // stops the pid watcher
  grpc::Status RegisterSource(grpc::ServerContext* context,
                              const v1::RegisterSourceRequest* request,
                              v1::RegisterSourceResponse* response) override;
  grpc::Status RegisterDestination(
      grpc::ServerContext* context,
      const v1::RegisterDestinationRequest* request,
      v1::RegisterDestinationResponse* response) override;
  grpc::Status Deregister(grpc::ServerContext* context,
                          const v1::DeregisterRequest* request,
                          v1::DeregisterResponse* response) override
      ABSL_LOCKS_EXCLUDED(mu_);
  // Batched with the other ranks' heartbeats (call_batcher.h), lingering
  // a twentieth of the lease for them.
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status HeartbeatBatch(grpc::ServerContext* context,
                              const v1::HeartbeatBatchRequest* request,
                              v1::HeartbeatBatchResponse* response) override;
  grpc::Status UpdateRegions(grpc::ServerContext* context,
                             const v1::UpdateRegionsRequest* request,
                             v1::UpdateRegionsResponse* response) override;

 private:
  // Forwards a registration this member parsed and mapped (`parsed`) to
  // the coordinator, keeps its memory for transfers and watches its pid.
  grpc::Status Forward(grpc::ServerContext* context,
                       absl::StatusOr<std::unique_ptr<Participant>> parsed,
                       v1::ForwardRegistrationRequest* request,
                       v1::ParticipantHandle* handle, int64_t* lease_ms);
  void Watch(const v1::ParticipantHandle& handle, int32_t pid)
      ABSL_LOCKS_EXCLUDED(mu_);
  void WatchLoop() ABSL_LOCKS_EXCLUDED(mu_);

  const ForwardingContext c_;
  std::unique_ptr<v1::Peer::Stub> peer_;
  std::unique_ptr<v1::Registry::Stub> registry_;
  CallBatcher<v1::HeartbeatRequest, v1::HeartbeatResponse> heartbeats_;
  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // participant id -> (handle, pid) of clients registered through here.
  std::map<std::string, std::pair<v1::ParticipantHandle, int32_t>> pids_
      ABSL_GUARDED_BY(mu_);
  std::thread watcher_;
};

// Subscribe is a callback stream relayed upstream with the node's other
// ranks' streams on one call (subscription_relay.h); BeginVersion and
// CommitVersion are callback calls relayed upstream, and Ack a callback
// call batched with the node's other acks: none holds a thread.
class ForwardingVersionsService final
    : public v1::Versions::WithCallbackMethod_BeginVersion<
          v1::Versions::WithCallbackMethod_CommitVersion<
              v1::Versions::WithCallbackMethod_Subscribe<
                  v1::Versions::WithCallbackMethod_Ack<
                      v1::Versions::Service>>>> {
 public:
  explicit ForwardingVersionsService(ForwardingContext context);
  grpc::ServerUnaryReactor* BeginVersion(
      grpc::CallbackServerContext* context,
      const v1::BeginVersionRequest* request,
      v1::BeginVersionResponse* response) override;
  grpc::ServerUnaryReactor* CommitVersion(
      grpc::CallbackServerContext* context,
      const v1::CommitVersionRequest* request,
      v1::CommitVersionResponse* response) override;
  grpc::Status AbortVersion(grpc::ServerContext* context,
                            const v1::AbortVersionRequest* request,
                            v1::AbortVersionResponse* response) override;
  grpc::ServerWriteReactor<v1::UpdateEvent>* Subscribe(
      grpc::CallbackServerContext* context,
      const v1::SubscribeRequest* request) override;
  // Batched with the other ranks' acks (call_batcher.h), sent at once.
  grpc::ServerUnaryReactor* Ack(grpc::CallbackServerContext* context,
                                const v1::AckRequest* request,
                                v1::AckResponse* response) override;
  grpc::Status AckBatch(grpc::ServerContext* context,
                        const v1::AckBatchRequest* request,
                        v1::AckBatchResponse* response) override;
  grpc::Status WaitForVersion(grpc::ServerContext* context,
                              const v1::WaitForVersionRequest* request,
                              v1::WaitForVersionResponse* response) override;

 private:
  const ForwardingContext c_;
  std::unique_ptr<v1::Versions::Stub> stub_;
  AsyncCallBatcher<v1::AckRequest, v1::AckResponse> acks_;
  SubscriptionRelay subscriptions_{stub_.get()};  // uses stub_: declared after
};

class ForwardingInspectionService final : public v1::Inspection::Service {
 public:
  // `local` answers GetHealth (not owned).
  ForwardingInspectionService(ForwardingContext context,
                              v1::Inspection::Service* local);
  grpc::Status ListParticipants(
      grpc::ServerContext* context, const v1::ListParticipantsRequest* request,
      v1::ListParticipantsResponse* response) override;
  grpc::Status ListStreams(grpc::ServerContext* context,
                           const v1::ListStreamsRequest* request,
                           v1::ListStreamsResponse* response) override;
  grpc::Status ExplainPlan(grpc::ServerContext* context,
                           const v1::ExplainPlanRequest* request,
                           v1::ExplainPlanResponse* response) override;
  grpc::Status GetProgress(grpc::ServerContext* context,
                           const v1::GetProgressRequest* request,
                           v1::GetProgressResponse* response) override;
  grpc::Status ListVersions(grpc::ServerContext* context,
                            const v1::ListVersionsRequest* request,
                            v1::ListVersionsResponse* response) override;
  grpc::Status GetHealth(grpc::ServerContext* context,
                         const v1::GetHealthRequest* request,
                         v1::GetHealthResponse* response) override;
  grpc::Status VerifyInstance(grpc::ServerContext* context,
                              const v1::VerifyInstanceRequest* request,
                              v1::VerifyInstanceResponse* response) override;

 private:
  const ForwardingContext c_;
  v1::Inspection::Service* const local_;
  std::unique_ptr<v1::Inspection::Stub> stub_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_FORWARDING_H_
