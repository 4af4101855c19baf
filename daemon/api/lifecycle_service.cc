#include "daemon/api/lifecycle_service.h"

#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/limits.h"
#include "daemon/api/call_deadline.h"
#include "daemon/registry/load_options.h"
#include "daemon/registry/registration_parser.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {

absl::Status LifecycleService::RefuseOnMember(const char* rpc) const {
  if (options_.coordinator_address.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(rpc, ": this ferryd is a member; call the coordinator at ",
                   options_.coordinator_address));
}

absl::Status LifecycleService::MayChange(const grpc::ServerContext& context,
                                         const std::string& instance_id,
                                         const char* rpc) const {
  absl::StatusOr<Caller> caller = callers_->Of(context);
  if (!caller.ok()) return caller.status();
  // Over TCP only cluster-authenticated operators reach Lifecycle (mutual
  // TLS); root may act for anyone.
  if (!caller->unix_socket() || caller->uid == 0) return absl::OkStatus();
  absl::StatusOr<std::string> stream = registry_->StreamOfInstance(instance_id);
  if (!stream.ok()) return stream.status();
  absl::StatusOr<Registry::StreamSnapshot> snap = registry_->Snapshot(*stream);
  if (!snap.ok()) return snap.status();
  for (const Registry::InstanceMembers& m : snap->instances) {
    if (m.id != instance_id) continue;
    for (const auto& r : m.ranks) {
      if (r != nullptr && (!r->owner_known || r->owner_uid != caller->uid)) {
        return absl::PermissionDeniedError(absl::StrCat(
            rpc, "(", instance_id, "): tp rank ", r->tp_rank, " was ",
            r->owner_known ? absl::StrCat("registered by uid ", r->owner_uid)
                           : std::string("registered through a member daemon"),
            "; uid ", caller->uid, " may change only its own instances "
            "(root may change any)"));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> LifecycleService::StreamToChange(
    const grpc::ServerContext& context, const std::string& instance_id,
    const char* rpc) const {
  if (absl::Status m = RefuseOnMember(rpc); !m.ok()) return m;
  absl::Status s = ValidateName("instance_id", instance_id);
  if (!s.ok()) return s;
  absl::StatusOr<std::string> stream = registry_->StreamOfInstance(instance_id);
  if (!stream.ok()) return stream.status();
  s = MayChange(context, instance_id, rpc);
  if (!s.ok()) return s;
  return stream;
}

grpc::Status LifecycleService::ReloadInPlace(
    grpc::ServerContext* context, const v1::ReloadInPlaceRequest* request,
    v1::ReloadInPlaceResponse* response) {
  absl::StatusOr<std::string> stream =
      StreamToChange(*context, request->instance_id(), "ReloadInPlace");
  if (!stream.ok()) return ToGrpcStatus(stream.status());
  absl::StatusOr<v1::InstanceStatus> status =
      coordinator_->deliveries().ReloadInPlace(*stream, request->instance_id(),
                                               ExpiryOf(context));
  if (!status.ok()) return ToGrpcStatus(status.status());
  *response->mutable_status() = *std::move(status);
  return grpc::Status::OK;
}
grpc::Status LifecycleService::SwapModel(
    grpc::ServerContext* context, const v1::SwapModelRequest* request,
    v1::SwapModelResponse* response) {
  if (absl::Status m = RefuseOnMember("SwapModel"); !m.ok()) {
    return ToGrpcStatus(m);
  }
  if (!request->has_handle() || !request->has_new_registration()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        "SwapModel: handle and new_registration are required"));
  }
  absl::StatusOr<std::shared_ptr<const Participant>> old =
      registry_->Authenticate(request->handle());
  if (!old.ok()) return ToGrpcStatus(old.status());
  if ((*old)->role != Role::kDestination) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "SwapModel is for destination ranks; ", (*old)->Describe(),
        " is not one")));
  }
  const v1::DestinationRegistration& next = request->new_registration();
  const std::string who = (*old)->Describe();
  if ((*old)->node != options_.node) {
    // Its memory is mapped by the member it registered through; mapping the
    // new registration there is not built yet.
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "SwapModel from ", who, ": the rank registered through the member "
        "daemon of node ", (*old)->node, "; swapping ranks on members is not "
        "built yet (deregister and register the new model instead)")));
  }
  if (next.instance_id() != (*old)->instance_id ||
      next.tp_rank() != (*old)->tp_rank || next.tp_size() != (*old)->tp_size) {
    const absl::Status bad = absl::InvalidArgumentError(absl::StrCat(
        "SwapModel from ", who, ": new_registration must keep instance_id ",
        (*old)->instance_id, ", tp_rank ", (*old)->tp_rank, " and tp_size ",
        (*old)->tp_size, " (it says ", Quote(next.instance_id()), ", ",
        next.tp_rank(), ", ", next.tp_size(), ")"));
    swaps_.Fail((*old)->instance_id, (*old)->tp_rank, bad);
    return ToGrpcStatus(bad);
  }
  absl::StatusOr<MapOptions> mapping =
      RegistrationMapping(*callers_, *context, devices_, /*write=*/true);
  if (!mapping.ok()) return ToGrpcStatus(mapping.status());
  absl::StatusOr<std::unique_ptr<Participant>> parsed =
      ParseDestinationRegistration(next, options_.node, *mapping);
  if (!parsed.ok()) {
    swaps_.Fail((*old)->instance_id, (*old)->tp_rank, parsed.status());
    return ToGrpcStatus(parsed.status());
  }
  absl::StatusOr<std::shared_ptr<const Participant>> swapped =
      swaps_.Swap(*old, *std::move(parsed), ExpiryOf(context));
  if (!swapped.ok()) return ToGrpcStatus(swapped.status());
  response->mutable_handle()->set_participant_id((*swapped)->id);
  response->mutable_handle()->set_token((*swapped)->token);
  response->set_lease_duration_ms(
      absl::ToInt64Milliseconds(registry_->lease()));
  return grpc::Status::OK;
}

grpc::Status LifecycleService::UpdateConfig(
    grpc::ServerContext* context, const v1::UpdateConfigRequest* request,
    v1::UpdateConfigResponse* response) {
  if (absl::Status m = RefuseOnMember("UpdateConfig"); !m.ok()) {
    return ToGrpcStatus(m);
  }
  absl::Status s = ValidateName("instance_id", request->instance_id());
  if (s.ok()) s = CheckConfigLimits(*request);
  if (!s.ok()) return ToGrpcStatus(s);
  const std::string& id = request->instance_id();
  absl::StatusOr<LoadOptions> current = registry_->InstanceOptions(id);
  if (!current.ok()) return ToGrpcStatus(current.status());
  // Reading the options is anyone's; changing them the instance's owner's.
  if (!request->set_options().empty() || !request->clear_options().empty()) {
    s = MayChange(*context, id, "UpdateConfig");
    if (!s.ok()) return ToGrpcStatus(s);
  }
  const std::map<std::string, std::string> set(
      request->set_options().begin(), request->set_options().end());
  const std::vector<std::string> clear(request->clear_options().begin(),
                                       request->clear_options().end());
  absl::StatusOr<LoadOptions> next = ApplyLoadOptions(*current, set, clear);
  if (!next.ok()) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "UpdateConfig(", id, "): ", next.status().message())));
  }
  if (next->load_format != current->load_format) {
    // Refused now rather than at the next version: a direct_only table
    // that needs the loader, fallback_only without an engine table.
    absl::StatusOr<std::string> stream = registry_->StreamOfInstance(id);
    if (!stream.ok()) return ToGrpcStatus(stream.status());
    absl::StatusOr<std::shared_ptr<const StreamPlan>> plan =
        plans_->Get(*stream);
    if (plan.ok()) {
      const int32_t at = (*plan)->FindInstance(id);
      if (at >= 0) {
        s = CheckLoadFormat(**plan, at, next->load_format);
        if (!s.ok()) {
          return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
              "UpdateConfig(", id, "): ", s.message())));
        }
      }
    }
  }
  if (!(*next == *current)) {
    s = registry_->SetInstanceOptions(id, *next);
    if (!s.ok()) return ToGrpcStatus(s);
  }
  for (const auto& [key, value] : LoadOptionsToMap(*next)) {
    (*response->mutable_options())[key] = value;
  }
  return grpc::Status::OK;
}
grpc::Status LifecycleService::LoadAdapter(
    grpc::ServerContext* context, const v1::LoadAdapterRequest* request,
    v1::LoadAdapterResponse* response) {
  absl::StatusOr<std::string> stream =
      StreamToChange(*context, request->instance_id(), "LoadAdapter");
  absl::Status s = stream.status();
  if (s.ok()) s = ValidateName("adapter_name", request->adapter_name());
  if (s.ok()) s = ValidateName("adapter_stream", request->adapter_stream());
  if (s.ok()) s = CheckAdapterConfigLimits(request->adapter_config_json());
  if (s.ok() && request->adapter_config_json().empty()) {
    s = absl::InvalidArgumentError(
        "LoadAdapter: adapter_config_json is required (the PEFT "
        "adapter_config.json text)");
  }
  if (!s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<v1::InstanceStatus> status =
      adapters_.Load(*stream, *request, ExpiryOf(context));
  if (!status.ok()) return ToGrpcStatus(status.status());
  *response->mutable_status() = *std::move(status);
  return grpc::Status::OK;
}

grpc::Status LifecycleService::UpdateAdapter(
    grpc::ServerContext* context, const v1::UpdateAdapterRequest* request,
    v1::UpdateAdapterResponse* response) {
  absl::StatusOr<std::string> stream =
      StreamToChange(*context, request->instance_id(), "UpdateAdapter");
  absl::Status s = stream.status();
  if (s.ok()) s = ValidateName("adapter_name", request->adapter_name());
  if (s.ok() && !request->adapter_stream().empty()) {
    s = ValidateName("adapter_stream", request->adapter_stream());
  }
  if (s.ok()) s = CheckAdapterConfigLimits(request->adapter_config_json());
  if (!s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<v1::InstanceStatus> status =
      adapters_.Update(*stream, *request, ExpiryOf(context));
  if (!status.ok()) return ToGrpcStatus(status.status());
  *response->mutable_status() = *std::move(status);
  return grpc::Status::OK;
}

grpc::Status LifecycleService::UnloadAdapter(
    grpc::ServerContext* context, const v1::UnloadAdapterRequest* request,
    v1::UnloadAdapterResponse*) {
  absl::StatusOr<std::string> stream =
      StreamToChange(*context, request->instance_id(), "UnloadAdapter");
  absl::Status s = stream.status();
  if (s.ok()) s = ValidateName("adapter_name", request->adapter_name());
  if (s.ok()) s = adapters_.Unload(*request, ExpiryOf(context));
  return ToGrpcStatus(s);
}

grpc::Status LifecycleService::Offload(grpc::ServerContext* context,
                                       const v1::OffloadRequest* request,
                                       v1::OffloadResponse* response) {
  absl::StatusOr<std::string> stream =
      StreamToChange(*context, request->instance_id(), "Offload");
  if (!stream.ok()) return ToGrpcStatus(stream.status());
  // Its adapters' versions would still reach it: unloaded first, loaded
  // again after Onload.
  std::vector<v1::AdapterInfo> adapters =
      AdaptersOf(*registry_, *coordinator_, request->instance_id());
  if (!adapters.empty()) {
    std::vector<std::string> names;
    for (const v1::AdapterInfo& a : adapters) names.push_back(a.name());
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "Offload(", request->instance_id(), "): adapters ",
        absl::StrJoin(names, ", "), " are loaded on the instance; "
        "UnloadAdapter them first (and LoadAdapter again after Onload)")));
  }
  absl::StatusOr<v1::InstanceStatus> status = coordinator_->offloads().Offload(
      *stream, request->instance_id(), request->keep_host_copy(),
      ExpiryOf(context));
  if (!status.ok()) return ToGrpcStatus(status.status());
  *response->mutable_status() = *std::move(status);
  return grpc::Status::OK;
}

grpc::Status LifecycleService::Onload(grpc::ServerContext* context,
                                      const v1::OnloadRequest* request,
                                      v1::OnloadResponse* response) {
  absl::StatusOr<std::string> stream =
      StreamToChange(*context, request->instance_id(), "Onload");
  if (!stream.ok()) return ToGrpcStatus(stream.status());
  absl::StatusOr<v1::InstanceStatus> status = coordinator_->offloads().Onload(
      *stream, request->instance_id(), ExpiryOf(context));
  if (!status.ok()) return ToGrpcStatus(status.status());
  *response->mutable_status() = *std::move(status);
  return grpc::Status::OK;
}

}  // namespace ferry
