#include "daemon/cluster/forwarding.h"

#include <errno.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/limits.h"
#include "daemon/cluster/forwarded_call.h"
#include "daemon/registry/registration_parser.h"
#include "glog/logging.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {
namespace {

// The longest a member holds a rank's heartbeat for others to batch with.
constexpr absl::Duration kMaxHeartbeatLinger = absl::Milliseconds(500);

}  // namespace

// ---------------------------------------------------------------------------
// Registry

ForwardingRegistryService::ForwardingRegistryService(ForwardingContext context)
    : c_(std::move(context)),
      peer_(v1::Peer::NewStub(c_.coordinator)),
      registry_(v1::Registry::NewStub(c_.coordinator)),
      heartbeats_(
          [this](const std::vector<const v1::HeartbeatRequest*>& requests,
                 std::chrono::system_clock::time_point deadline) {
            v1::HeartbeatBatchRequest batch;
            for (const v1::HeartbeatRequest* r : requests) {
              *batch.add_heartbeats() = *r;
            }
            grpc::ClientContext context;
            context.set_deadline(deadline);
            v1::HeartbeatBatchResponse response;
            const grpc::Status s =
                registry_->HeartbeatBatch(&context, batch, &response);
            return Answers<v1::HeartbeatResponse>(
                s, response, requests.size(),
                [](const v1::HeartbeatOutcome& o)
                    -> absl::StatusOr<v1::HeartbeatResponse> {
                  if (absl::Status e = StatusOf(o); !e.ok()) return e;
                  v1::HeartbeatResponse r;
                  r.set_lease_duration_ms(o.lease_duration_ms());
                  return r;
                });
          },
          Limits::kMaxHeartbeatsPerBatch) {
  watcher_ = std::thread([this] { WatchLoop(); });
}

ForwardingRegistryService::~ForwardingRegistryService() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  watcher_.join();
}

void ForwardingRegistryService::Watch(const v1::ParticipantHandle& handle,
                                      int32_t pid) {
  if (pid <= 0) return;
  absl::MutexLock lock(&mu_);
  pids_[handle.participant_id()] = {handle, pid};
}

void ForwardingRegistryService::WatchLoop() {
  while (true) {
    std::vector<v1::ParticipantHandle> gone;
    {
      absl::MutexLock lock(&mu_);
      if (mu_.AwaitWithTimeout(absl::Condition(&stopping_),
                               absl::Milliseconds(100))) {
        return;
      }
      for (auto it = pids_.begin(); it != pids_.end();) {
        if (::kill(it->second.second, 0) != 0 && errno == ESRCH) {
          gone.push_back(it->second.first);
          it = pids_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (const v1::ParticipantHandle& handle : gone) {
      v1::DeregisterRequest request;
      *request.mutable_handle() = handle;
      v1::DeregisterResponse response;
      grpc::ClientContext client;
      client.set_deadline(std::chrono::system_clock::now() +
                          std::chrono::seconds(5));
      grpc::Status s = registry_->Deregister(&client, request, &response);
      LOG(INFO) << "participant " << handle.participant_id()
                << ": its process exited; forwarded Deregister: "
                << (s.ok() ? "OK" : s.error_message());
      c_.route_memory->RemoveLocal(handle.participant_id());
      if (c_.memory != nullptr) c_.memory->Forget(handle.participant_id());
    }
  }
}

grpc::Status ForwardingRegistryService::Forward(
    grpc::ServerContext* context,
    absl::StatusOr<std::unique_ptr<Participant>> parsed,
    v1::ForwardRegistrationRequest* request, v1::ParticipantHandle* handle,
    int64_t* lease_ms) {
  if (!parsed.ok()) return ToGrpcStatus(parsed.status());
  *request->mutable_member() = c_.link->handle();
  if (request->member().node().empty()) {
    return ToGrpcStatus(absl::UnavailableError(absl::StrCat(
        "node ", c_.node, " has not joined its coordinator yet; retry")));
  }
  grpc::ClientContext client;
  Prepare(context, &client);
  v1::ForwardRegistrationResponse response;
  grpc::Status s = peer_->ForwardRegistration(&client, *request, &response);
  if (!s.ok()) return s;
  c_.route_memory->AddLocal(response.handle().participant_id(),
                         (*parsed)->memory);
  *handle = response.handle();
  *lease_ms = response.lease_duration_ms();
  Watch(*handle, (*parsed)->pid);
  return grpc::Status::OK;
}

grpc::Status ForwardingRegistryService::RegisterSource(
    grpc::ServerContext* context, const v1::RegisterSourceRequest* request,
    v1::RegisterSourceResponse* response) {
  if (!request->has_source()) {
    return ToGrpcStatus(absl::InvalidArgumentError("source is required"));
  }
  v1::ForwardRegistrationRequest forward;
  *forward.mutable_source() = *request;
  int64_t lease_ms = 0;
  absl::StatusOr<MapOptions> mapping = RegistrationMapping(
      *c_.callers, *context, c_.devices, /*write=*/false);
  if (!mapping.ok()) return ToGrpcStatus(mapping.status());
  grpc::Status s = Forward(
      context, ParseSourceRegistration(request->source(), c_.node, *mapping),
      &forward, response->mutable_handle(), &lease_ms);
  response->set_lease_duration_ms(lease_ms);
  return s;
}

grpc::Status ForwardingRegistryService::RegisterDestination(
    grpc::ServerContext* context, const v1::RegisterDestinationRequest* request,
    v1::RegisterDestinationResponse* response) {
  if (!request->has_destination()) {
    return ToGrpcStatus(absl::InvalidArgumentError("destination is required"));
  }
  v1::ForwardRegistrationRequest forward;
  *forward.mutable_destination() = *request;
  int64_t lease_ms = 0;
  absl::StatusOr<MapOptions> mapping = RegistrationMapping(
      *c_.callers, *context, c_.devices, /*write=*/true);
  if (!mapping.ok()) return ToGrpcStatus(mapping.status());
  grpc::Status s = Forward(
      context,
      ParseDestinationRegistration(request->destination(), c_.node, *mapping),
      &forward, response->mutable_handle(), &lease_ms);
  response->set_lease_duration_ms(lease_ms);
  return s;
}

grpc::Status ForwardingRegistryService::Deregister(
    grpc::ServerContext* context, const v1::DeregisterRequest* request,
    v1::DeregisterResponse* response) {
  grpc::Status s =
      ForwardCall(context, registry_.get(), &v1::Registry::Stub::Deregister,
                  request, response);
  if (s.ok()) {
    c_.route_memory->RemoveLocal(request->handle().participant_id());
    if (c_.memory != nullptr) {
      c_.memory->Forget(request->handle().participant_id());
    }
    absl::MutexLock lock(&mu_);
    pids_.erase(request->handle().participant_id());
  }
  return s;
}

grpc::Status ForwardingRegistryService::Heartbeat(
    grpc::ServerContext* context, const v1::HeartbeatRequest* request,
    v1::HeartbeatResponse* response) {
  // Checked here too: a heartbeat the coordinator would refuse must not
  // ride in a batch with other ranks' heartbeats.
  if (absl::Status s = CheckHandleLimits(request->handle()); !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<v1::HeartbeatResponse> answer =
      heartbeats_.Call(*request, DeadlineOf(context));
  if (!answer.ok()) return ToGrpcStatus(answer.status());
  *response = *std::move(answer);
  // Ranks renew every third of the lease: waiting a twentieth of it for
  // the node's other ranks delays no renewal that matters.
  heartbeats_.set_linger(std::min(
      kMaxHeartbeatLinger,
      absl::Milliseconds(response->lease_duration_ms()) / 20));
  return grpc::Status::OK;
}

grpc::Status ForwardingRegistryService::HeartbeatBatch(
    grpc::ServerContext* context, const v1::HeartbeatBatchRequest* request,
    v1::HeartbeatBatchResponse* response) {
  return ForwardCall(context, registry_.get(),
                     &v1::Registry::Stub::HeartbeatBatch, request, response);
}

grpc::Status ForwardingRegistryService::UpdateRegions(
    grpc::ServerContext* context, const v1::UpdateRegionsRequest* request,
    v1::UpdateRegionsResponse* response) {
  // The new memory is on this node: mapped here (with the caller's rights,
  // as at registration) before the coordinator hears of it; kept only if
  // the coordinator takes the update (its checks: the handle, the offload
  // window, ids and sizes).
  if (absl::Status s = CheckUpdateRegionsLimits(*request); !s.ok()) {
    return ToGrpcStatus(s);
  }
  const std::string id = request->handle().participant_id();
  std::shared_ptr<const MemoryMap> old = c_.route_memory->LocalMemory(id);
  if (old == nullptr) {
    return ForwardCall(context, registry_.get(),
                       &v1::Registry::Stub::UpdateRegions, request, response);
  }
  // Every region is listed: a member keeps no region's old handle.
  std::vector<v1::MemoryRegion> registered;
  for (size_t i = 0; i < old->size(); ++i) {
    v1::MemoryRegion r;
    r.set_region_id(old->region_id(i));
    r.set_size_bytes(old->bytes(i));
    if (old->on_device(i)) {
      r.mutable_cuda_ipc();
    } else {
      r.mutable_shared_memory();
    }
    registered.push_back(std::move(r));
  }
  const std::string who = absl::StrCat("participant ", id);
  if (request->regions_size() != static_cast<int>(registered.size())) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        who, ": UpdateRegions through a member daemon lists every region (",
        registered.size(), "); it lists ", request->regions_size())));
  }
  absl::StatusOr<MapOptions> mapping = RegistrationMapping(
      *c_.callers, *context, c_.devices, /*write=*/true);
  if (!mapping.ok()) return ToGrpcStatus(mapping.status());
  absl::StatusOr<RemappedRegions> remapped =
      RemapRegions(who, registered, request->regions(), *mapping);
  if (!remapped.ok()) return ToGrpcStatus(remapped.status());
  grpc::Status s =
      ForwardCall(context, registry_.get(), &v1::Registry::Stub::UpdateRegions,
                  request, response);
  if (s.ok()) c_.route_memory->AddLocal(id, std::move(remapped->memory));
  return s;
}

// ---------------------------------------------------------------------------
// Versions

ForwardingVersionsService::ForwardingVersionsService(ForwardingContext context)
    : c_(std::move(context)),
      stub_(v1::Versions::NewStub(c_.coordinator)),
      acks_(
          [this](const std::vector<const v1::AckRequest*>& requests,
                 std::chrono::system_clock::time_point deadline,
                 AsyncCallBatcher<v1::AckRequest, v1::AckResponse>::Answered
                     answered) {
            // The batch call's state, alive until its callback ran.
            struct Call {
              grpc::ClientContext context;
              v1::AckBatchRequest batch;
              v1::AckBatchResponse response;
            };
            auto call = std::make_shared<Call>();
            for (const v1::AckRequest* r : requests) {
              *call->batch.add_acks() = *r;
            }
            call->context.set_deadline(deadline);
            const size_t asked = requests.size();
            stub_->async()->AckBatch(
                &call->context, &call->batch, &call->response,
                [call, asked, answered = std::move(answered)](grpc::Status s) {
                  answered(Answers<v1::AckResponse>(
                      s, call->response, asked,
                      [](const v1::AckOutcome& o)
                          -> absl::StatusOr<v1::AckResponse> {
                        if (absl::Status e = StatusOf(o); !e.ok()) return e;
                        return v1::AckResponse();
                      }));
                });
          },
          Limits::kMaxAcksPerBatch) {}

grpc::ServerUnaryReactor* ForwardingVersionsService::BeginVersion(
    grpc::CallbackServerContext* context,
    const v1::BeginVersionRequest* request,
    v1::BeginVersionResponse* response) {
  v1::Versions::Stub* stub = stub_.get();
  return new Forwarded(context, [stub, request, response](
                                    grpc::ClientContext* upstream,
                                    std::function<void(grpc::Status)> done) {
    stub->async()->BeginVersion(upstream, request, response, std::move(done));
  });
}

grpc::ServerUnaryReactor* ForwardingVersionsService::CommitVersion(
    grpc::CallbackServerContext* context,
    const v1::CommitVersionRequest* request,
    v1::CommitVersionResponse* response) {
  v1::Versions::Stub* stub = stub_.get();
  return new Forwarded(context, [stub, request, response](
                                    grpc::ClientContext* upstream,
                                    std::function<void(grpc::Status)> done) {
    stub->async()->CommitVersion(upstream, request, response, std::move(done));
  });
}

grpc::Status ForwardingVersionsService::AbortVersion(
    grpc::ServerContext* context, const v1::AbortVersionRequest* request,
    v1::AbortVersionResponse* response) {
  return ForwardCall(context, stub_.get(), &v1::Versions::Stub::AbortVersion,
                     request, response);
}

grpc::ServerUnaryReactor* ForwardingVersionsService::Ack(
    grpc::CallbackServerContext* context, const v1::AckRequest* request,
    v1::AckResponse*) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  // Checked here too: an ack the coordinator would refuse must not ride in
  // a batch with other ranks' acks.
  if (absl::Status s = CheckAckLimits(*request); !s.ok()) {
    reactor->Finish(ToGrpcStatus(s));
    return reactor;
  }
  acks_.Call(*request, DeadlineOf(context),
             [reactor](absl::StatusOr<v1::AckResponse> answer) {
               reactor->Finish(ToGrpcStatus(answer.status()));
             });
  return reactor;
}

grpc::Status ForwardingVersionsService::AckBatch(
    grpc::ServerContext* context, const v1::AckBatchRequest* request,
    v1::AckBatchResponse* response) {
  return ForwardCall(context, stub_.get(), &v1::Versions::Stub::AckBatch,
                     request, response);
}

grpc::Status ForwardingVersionsService::WaitForVersion(
    grpc::ServerContext* context, const v1::WaitForVersionRequest* request,
    v1::WaitForVersionResponse* response) {
  return ForwardCall(context, stub_.get(), &v1::Versions::Stub::WaitForVersion,
                     request, response);
}

grpc::ServerWriteReactor<v1::UpdateEvent>* ForwardingVersionsService::Subscribe(
    grpc::CallbackServerContext* context, const v1::SubscribeRequest* request) {
  return subscriptions_.Subscribe(*request);
}

// ---------------------------------------------------------------------------
// Inspection

ForwardingInspectionService::ForwardingInspectionService(
    ForwardingContext context, v1::Inspection::Service* local)
    : c_(std::move(context)),
      local_(local),
      stub_(v1::Inspection::NewStub(c_.coordinator)) {}

grpc::Status ForwardingInspectionService::ListParticipants(
    grpc::ServerContext* context, const v1::ListParticipantsRequest* request,
    v1::ListParticipantsResponse* response) {
  return ForwardCall(context, stub_.get(),
                     &v1::Inspection::Stub::ListParticipants, request,
                     response);
}

grpc::Status ForwardingInspectionService::ListStreams(
    grpc::ServerContext* context, const v1::ListStreamsRequest* request,
    v1::ListStreamsResponse* response) {
  return ForwardCall(context, stub_.get(), &v1::Inspection::Stub::ListStreams,
                     request, response);
}

grpc::Status ForwardingInspectionService::ExplainPlan(
    grpc::ServerContext* context, const v1::ExplainPlanRequest* request,
    v1::ExplainPlanResponse* response) {
  return ForwardCall(context, stub_.get(), &v1::Inspection::Stub::ExplainPlan,
                     request, response);
}

grpc::Status ForwardingInspectionService::GetProgress(
    grpc::ServerContext* context, const v1::GetProgressRequest* request,
    v1::GetProgressResponse* response) {
  return ForwardCall(context, stub_.get(), &v1::Inspection::Stub::GetProgress,
                     request, response);
}

grpc::Status ForwardingInspectionService::ListVersions(
    grpc::ServerContext* context, const v1::ListVersionsRequest* request,
    v1::ListVersionsResponse* response) {
  return ForwardCall(context, stub_.get(), &v1::Inspection::Stub::ListVersions,
                     request, response);
}

grpc::Status ForwardingInspectionService::VerifyInstance(
    grpc::ServerContext* context, const v1::VerifyInstanceRequest* request,
    v1::VerifyInstanceResponse* response) {
  return ForwardCall(context, stub_.get(),
                     &v1::Inspection::Stub::VerifyInstance, request, response);
}

grpc::Status ForwardingInspectionService::GetHealth(
    grpc::ServerContext* context, const v1::GetHealthRequest* request,
    v1::GetHealthResponse* response) {
  return local_->GetHealth(context, request, response);
}

}  // namespace ferry
