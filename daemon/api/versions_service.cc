#include "daemon/api/versions_service.h"

#include "absl/strings/str_cat.h"
#include "daemon/api/call_deadline.h"
#include "daemon/api/subscribe_relay_stream.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {

VersionsService::VersionsService(Registry* registry,
                                 VersionCoordinator* coordinator)
    : registry_(registry), coordinator_(coordinator) {}

absl::StatusOr<std::shared_ptr<const Participant>> VersionsService::Caller(
    const v1::ParticipantHandle& handle, Role role, const char* rpc) const {
  absl::StatusOr<std::shared_ptr<const Participant>> p =
      registry_->Authenticate(handle);
  if (!p.ok()) return p.status();
  if ((*p)->role != role) {
    return absl::FailedPreconditionError(absl::StrCat(
        rpc, " is for ", role == Role::kSource ? "source" : "destination",
        " ranks; ", (*p)->Describe(), " (", (*p)->id, ") is not one"));
  }
  return p;
}

grpc::Status VersionsService::BeginVersion(
    grpc::ServerContext* context, const v1::BeginVersionRequest* request,
    v1::BeginVersionResponse* response) {
  auto source = Caller(request->handle(), Role::kSource, "BeginVersion");
  if (!source.ok()) return ToGrpcStatus(source.status());
  absl::StatusOr<std::vector<std::string>> ids = coordinator_->BeginVersion(
      *source, request->version(), ExpiryOf(context));
  if (!ids.ok()) return ToGrpcStatus(ids.status());
  for (const std::string& id : *ids) response->add_instance_ids(id);
  return grpc::Status::OK;
}

grpc::ServerUnaryReactor* VersionsService::CommitVersion(
    grpc::CallbackServerContext* context,
    const v1::CommitVersionRequest* request,
    v1::CommitVersionResponse* response) {
  grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
  auto source = Caller(request->handle(), Role::kSource, "CommitVersion");
  if (!source.ok()) {
    reactor->Finish(ToGrpcStatus(source.status()));
    return reactor;
  }
  // A caller whose deadline passes gets DEADLINE_EXCEEDED from gRPC; its
  // commit counts all the same, and WaitForVersion tells the outcome.
  coordinator_->CommitVersion(
      **source, request->version(),
      [reactor, response](const VersionRun::Outcome& outcome) {
        if (!outcome.ok()) {
          reactor->Finish(ToGrpcStatus(outcome.status()));
          return;
        }
        for (const v1::InstanceStatus& s : *outcome) {
          *response->add_instances() = s;
        }
        reactor->Finish(grpc::Status::OK);
      });
  return reactor;
}

grpc::Status VersionsService::AbortVersion(
    grpc::ServerContext*, const v1::AbortVersionRequest* request,
    v1::AbortVersionResponse* response) {
  if (absl::Status s = CheckReasonLimits("reason", request->reason());
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  auto source = Caller(request->handle(), Role::kSource, "AbortVersion");
  if (!source.ok()) return ToGrpcStatus(source.status());
  auto outcome = coordinator_->AbortVersion(**source, request->version(),
                                            request->reason());
  if (!outcome.ok()) return ToGrpcStatus(outcome.status());
  for (auto& s : *outcome) *response->add_instances() = std::move(s);
  return grpc::Status::OK;
}

grpc::ServerWriteReactor<v1::UpdateEvent>* VersionsService::Subscribe(
    grpc::CallbackServerContext*, const v1::SubscribeRequest* request) {
  auto destination = Caller(request->handle(), Role::kDestination, "Subscribe");
  if (!destination.ok()) {
    return new RefusedStream<v1::UpdateEvent>(
        ToGrpcStatus(destination.status()));
  }
  return new SubscribeStream(coordinator_, &pump_, *std::move(destination));
}

grpc::ServerBidiReactor<v1::SubscribeRelayRequest, v1::SubscribeRelayResponse>*
VersionsService::SubscribeRelay(grpc::CallbackServerContext*) {
  return new SubscribeRelayStream(
      coordinator_, &pump_, [this](const v1::ParticipantHandle& handle) {
        return Caller(handle, Role::kDestination, "Subscribe");
      });
}

absl::Status VersionsService::AckOne(const v1::AckRequest& request) const {
  if (absl::Status s = CheckAckLimits(request); !s.ok()) return s;
  auto destination = Caller(request.handle(), Role::kDestination, "Ack");
  if (!destination.ok()) return destination.status();
  return coordinator_->Ack(**destination, request);
}

grpc::Status VersionsService::Ack(grpc::ServerContext*,
                                  const v1::AckRequest* request,
                                  v1::AckResponse*) {
  return ToGrpcStatus(AckOne(*request));
}

grpc::Status VersionsService::AckBatch(grpc::ServerContext*,
                                       const v1::AckBatchRequest* request,
                                       v1::AckBatchResponse* response) {
  if (absl::Status s = CheckAckBatchLimits(*request); !s.ok()) {
    return ToGrpcStatus(s);
  }
  for (const v1::AckRequest& ack : request->acks()) {
    const absl::Status s = AckOne(ack);
    v1::AckOutcome* outcome = response->add_outcomes();
    outcome->set_code(static_cast<int32_t>(s.code()));
    outcome->set_message(std::string(s.message()));
  }
  return grpc::Status::OK;
}

grpc::Status VersionsService::WaitForVersion(
    grpc::ServerContext* context, const v1::WaitForVersionRequest* request,
    v1::WaitForVersionResponse* response) {
  absl::Status s = ValidateName("stream", request->stream());
  if (s.ok() && !request->instance_id().empty()) {
    s = ValidateName("instance_id", request->instance_id());
  }
  if (s.ok() && request->version() <= 0) {
    s = absl::InvalidArgumentError(absl::StrCat(
        "version ", request->version(), " must be > 0"));
  }
  if (s.ok() && request->timeout_ms() <= 0) {
    s = absl::InvalidArgumentError(absl::StrCat(
        "timeout_ms ", request->timeout_ms(), " must be > 0"));
  }
  if (!s.ok()) return ToGrpcStatus(s);
  // Answered from the coordinator's records, not the registry: once every
  // rank has left (engines exit after their last version, say) the stream
  // is gone from the registry, but the outcome of a version it kept a
  // record of is still asked for. Unknown streams and versions are
  // NOT_FOUND there.
  // Never past the call's own deadline: nobody would read the answer.
  const absl::Duration timeout =
      std::min(absl::Milliseconds(request->timeout_ms()),
               std::max(absl::ZeroDuration(),
                        CallDeadline(context) - absl::Now()));
  auto outcome = coordinator_->WaitForVersion(
      request->stream(), request->version(), request->instance_id(), timeout);
  if (!outcome.ok()) return ToGrpcStatus(outcome.status());
  for (auto& st : *outcome) *response->add_instances() = std::move(st);
  return grpc::Status::OK;
}

}  // namespace ferry
