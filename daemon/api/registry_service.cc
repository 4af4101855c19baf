#include "daemon/api/registry_service.h"

#include <utility>

#include "absl/strings/str_cat.h"

#include "daemon/api/call_deadline.h"
#include "daemon/registry/registration_parser.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {
namespace {

void FillHandle(const Participant& p, v1::ParticipantHandle* handle) {
  handle->set_participant_id(p.id);
  handle->set_token(p.token);
}

}  // namespace

RegistryService::RegistryService(Registry* registry, std::string node,
                                 DeviceMemory* devices,
                                 const CallerIdentity* callers,
                                 std::string coordinator_address)
    : registry_(registry),
      node_(std::move(node)),
      devices_(devices),
      callers_(callers),
      coordinator_address_(std::move(coordinator_address)) {}

absl::Status RegistryService::RefuseOnMember() const {
  if (coordinator_address_.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "node ", node_, " is a member of the coordinator at ",
      coordinator_address_,
      "; forwarding registrations to the coordinator is not built yet "
      "(docs/architecture.md, \"Several nodes\")"));
}

// The entry point of a registration, and the steps source and destination
// share (Register below): refused on a member; the memory's rights from the
// caller (RegistrationMapping); then the registration walk, four steps each
// done once (daemon/registry/registration_parser.h):
//   (a) limits on the wire message     proto/request_limits.h
//   (b) conversion to the core struct  proto/registration_convert.h
//   (c) the core check                 core/registration_rules.h
//   (d) memory mapped, Participant     daemon/registry/registration_parser.cc
// and last the Registry's lock, only to insert it (Registry::Add).
grpc::Status RegistryService::RegisterSource(
    grpc::ServerContext* context, const v1::RegisterSourceRequest* request,
    v1::RegisterSourceResponse* response) {
  if (absl::Status m = RefuseOnMember(); !m.ok()) return ToGrpcStatus(m);
  if (!request->has_source()) {
    return ToGrpcStatus(absl::InvalidArgumentError("source is required"));
  }
  int64_t lease_ms = 0;
  grpc::Status s = Register(
      context, Role::kSource,
      [&](const MapOptions& mapping) {
        return ParseSourceRegistration(request->source(), node_, mapping,
                                       registry_->declaration_cache());
      },
      request->replace_existing(), response->mutable_handle(), &lease_ms);
  if (s.ok()) response->set_lease_duration_ms(lease_ms);
  return s;
}

grpc::Status RegistryService::RegisterDestination(
    grpc::ServerContext* context, const v1::RegisterDestinationRequest* request,
    v1::RegisterDestinationResponse* response) {
  if (absl::Status m = RefuseOnMember(); !m.ok()) return ToGrpcStatus(m);
  if (!request->has_destination()) {
    return ToGrpcStatus(absl::InvalidArgumentError("destination is required"));
  }
  int64_t lease_ms = 0;
  grpc::Status s = Register(
      context, Role::kDestination,
      [&](const MapOptions& mapping) {
        return ParseDestinationRegistration(request->destination(), node_,
                                            mapping);
      },
      request->replace_existing(), response->mutable_handle(), &lease_ms);
  if (s.ok()) response->set_lease_duration_ms(lease_ms);
  return s;
}

grpc::Status RegistryService::Register(grpc::ServerContext* context,
                                       Role role, const Walk& walk,
                                       bool replace_existing,
                                       v1::ParticipantHandle* handle,
                                       int64_t* lease_ms) {
  // A destination's memory is written, a source's only read.
  absl::StatusOr<MapOptions> mapping = RegistrationMapping(
      *callers_, *context, devices_, /*write=*/role == Role::kDestination);
  if (!mapping.ok()) return ToGrpcStatus(mapping.status());
  // All four steps without a lock; the Registry's lock only for Add.
  absl::StatusOr<std::unique_ptr<Participant>> parsed = walk(*mapping);
  if (!parsed.ok()) return ToGrpcStatus(parsed.status());
  if (role == Role::kDestination) {
    // Lifecycle calls that change an instance are for its owner
    // (lifecycle_service.h); a source's owner is not asked for.
    (*parsed)->owner_known = mapping->access.check;
    (*parsed)->owner_uid = mapping->access.uid;
  }
  if (CallExpired(context)) {
    return ToGrpcStatus(Expired(
        (*parsed)->Describe(), "while the registration was parsed and "
        "mapped; nothing was registered"));
  }
  absl::StatusOr<std::shared_ptr<const Participant>> added =
      registry_->Add(*std::move(parsed), replace_existing);
  if (!added.ok()) return ToGrpcStatus(added.status());
  FillHandle(**added, handle);
  *lease_ms = absl::ToInt64Milliseconds(registry_->lease());
  return grpc::Status::OK;
}

grpc::Status RegistryService::Deregister(grpc::ServerContext*,
                                         const v1::DeregisterRequest* request,
                                         v1::DeregisterResponse*) {
  return ToGrpcStatus(registry_->Remove(request->handle()));
}

grpc::Status RegistryService::Heartbeat(grpc::ServerContext*,
                                        const v1::HeartbeatRequest* request,
                                        v1::HeartbeatResponse* response) {
  absl::Status s = registry_->Heartbeat(request->handle());
  if (!s.ok()) return ToGrpcStatus(s);
  response->set_lease_duration_ms(absl::ToInt64Milliseconds(registry_->lease()));
  return grpc::Status::OK;
}

grpc::Status RegistryService::HeartbeatBatch(
    grpc::ServerContext*, const v1::HeartbeatBatchRequest* request,
    v1::HeartbeatBatchResponse* response) {
  if (absl::Status s = CheckHeartbeatBatchLimits(*request); !s.ok()) {
    return ToGrpcStatus(s);
  }
  const int64_t lease_ms = absl::ToInt64Milliseconds(registry_->lease());
  for (const v1::HeartbeatRequest& heartbeat : request->heartbeats()) {
    absl::Status s = CheckHandleLimits(heartbeat.handle());
    if (s.ok()) s = registry_->Heartbeat(heartbeat.handle());
    v1::HeartbeatOutcome* outcome = response->add_outcomes();
    outcome->set_code(static_cast<int32_t>(s.code()));
    outcome->set_message(std::string(s.message()));
    if (s.ok()) outcome->set_lease_duration_ms(lease_ms);
  }
  return grpc::Status::OK;
}

grpc::Status RegistryService::UpdateRegions(
    grpc::ServerContext* context, const v1::UpdateRegionsRequest* request,
    v1::UpdateRegionsResponse*) {
  if (absl::Status m = RefuseOnMember(); !m.ok()) return ToGrpcStatus(m);
  if (absl::Status s = CheckUpdateRegionsLimits(*request); !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<std::shared_ptr<const Participant>> p =
      registry_->Authenticate(request->handle());
  if (!p.ok()) return ToGrpcStatus(p.status());
  if ((*p)->role != Role::kDestination) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        (*p)->Describe(), ": UpdateRegions is for destination ranks")));
  }
  const std::string fixed =
      regions_gate_ ? regions_gate_(**p) : "UpdateRegions is not served here";
  if (!fixed.empty()) {
    return ToGrpcStatus(absl::FailedPreconditionError(
        absl::StrCat((*p)->Describe(), ": UpdateRegions: ", fixed)));
  }
  // The new memory is opened with the caller's rights, as at registration;
  // a rank registered through a member has it mapped there (the member
  // did, before forwarding this call), so here it is only checked.
  absl::StatusOr<MapOptions> mapping =
      (*p)->memory != nullptr && !(*p)->memory->mapped()
          ? absl::StatusOr<MapOptions>(MapOptions{/*map_memory=*/false})
          : RegistrationMapping(*callers_, *context, devices_, /*write=*/true);
  if (!mapping.ok()) return ToGrpcStatus(mapping.status());
  absl::StatusOr<RemappedRegions> remapped =
      RemapRegions((*p)->Describe(), (*p)->regions, request->regions(),
                   *mapping);
  if (!remapped.ok()) return ToGrpcStatus(remapped.status());
  absl::StatusOr<std::shared_ptr<const Participant>> updated =
      registry_->ReplaceMemory(
          *p, (*p)->WithMemory(std::move(remapped->memory),
                               std::move(remapped->regions)));
  return ToGrpcStatus(updated.status());
}

}  // namespace ferry
