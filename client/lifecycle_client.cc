#include "client/lifecycle_client.h"

#include "absl/strings/str_cat.h"
#include "proto/ferry/v1/lifecycle.pb.h"
#include "proto/grpc_status.h"

namespace ferry {

absl::StatusOr<v1::InstanceStatus> ReloadInPlace(const Connection& connection,
                                                 const std::string& instance_id,
                                                 absl::Duration timeout) {
  v1::ReloadInPlaceRequest request;
  request.set_instance_id(instance_id);
  v1::ReloadInPlaceResponse response;
  auto context = connection.NewContext(timeout);
  const grpc::Status s =
      connection.lifecycle().ReloadInPlace(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("ReloadInPlace(", instance_id, ")"));
  }
  return response.status();
}

absl::StatusOr<v1::InstanceStatus> Offload(const Connection& connection,
                                           const std::string& instance_id,
                                           bool keep_host_copy,
                                           absl::Duration timeout) {
  v1::OffloadRequest request;
  request.set_instance_id(instance_id);
  request.set_keep_host_copy(keep_host_copy);
  v1::OffloadResponse response;
  auto context = connection.NewContext(timeout);
  const grpc::Status s =
      connection.lifecycle().Offload(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("Offload(", instance_id, ")"));
  }
  return response.status();
}

absl::StatusOr<v1::InstanceStatus> Onload(const Connection& connection,
                                          const std::string& instance_id,
                                          absl::Duration timeout) {
  v1::OnloadRequest request;
  request.set_instance_id(instance_id);
  v1::OnloadResponse response;
  auto context = connection.NewContext(timeout);
  const grpc::Status s =
      connection.lifecycle().Onload(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("Onload(", instance_id, ")"));
  }
  return response.status();
}

absl::StatusOr<v1::InstanceStatus> LoadAdapter(
    const Connection& connection, const std::string& instance_id,
    const std::string& adapter_name, const std::string& adapter_stream,
    const std::string& adapter_config_json, absl::Duration timeout) {
  v1::LoadAdapterRequest request;
  request.set_instance_id(instance_id);
  request.set_adapter_name(adapter_name);
  request.set_adapter_stream(adapter_stream);
  request.set_adapter_config_json(adapter_config_json);
  v1::LoadAdapterResponse response;
  auto context = connection.NewContext(timeout);
  const grpc::Status s =
      connection.lifecycle().LoadAdapter(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(
        s, absl::StrCat("LoadAdapter(", instance_id, ", ", adapter_name, ")"));
  }
  return response.status();
}

absl::StatusOr<v1::InstanceStatus> UpdateAdapter(
    const Connection& connection, const std::string& instance_id,
    const std::string& adapter_name, const std::string& adapter_stream,
    const std::string& adapter_config_json, absl::Duration timeout) {
  v1::UpdateAdapterRequest request;
  request.set_instance_id(instance_id);
  request.set_adapter_name(adapter_name);
  request.set_adapter_stream(adapter_stream);
  request.set_adapter_config_json(adapter_config_json);
  v1::UpdateAdapterResponse response;
  auto context = connection.NewContext(timeout);
  const grpc::Status s =
      connection.lifecycle().UpdateAdapter(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("UpdateAdapter(", instance_id, ", ",
                                          adapter_name, ")"));
  }
  return response.status();
}

absl::Status UnloadAdapter(const Connection& connection,
                           const std::string& instance_id,
                           const std::string& adapter_name,
                           absl::Duration timeout) {
  v1::UnloadAdapterRequest request;
  request.set_instance_id(instance_id);
  request.set_adapter_name(adapter_name);
  v1::UnloadAdapterResponse response;
  auto context = connection.NewContext(timeout);
  const grpc::Status s =
      connection.lifecycle().UnloadAdapter(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("UnloadAdapter(", instance_id, ", ",
                                          adapter_name, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::map<std::string, std::string>> UpdateConfig(
    const Connection& connection, const std::string& instance_id,
    const std::map<std::string, std::string>& set,
    const std::vector<std::string>& clear) {
  v1::UpdateConfigRequest request;
  request.set_instance_id(instance_id);
  for (const auto& [key, value] : set) {
    (*request.mutable_set_options())[key] = value;
  }
  for (const std::string& key : clear) request.add_clear_options(key);
  v1::UpdateConfigResponse response;
  auto context = connection.NewContext();
  const grpc::Status s =
      connection.lifecycle().UpdateConfig(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("UpdateConfig(", instance_id, ")"));
  }
  return std::map<std::string, std::string>(response.options().begin(),
                                            response.options().end());
}

absl::StatusOr<std::map<std::string, std::string>> GetConfig(
    const Connection& connection, const std::string& instance_id) {
  return UpdateConfig(connection, instance_id, {}, {});
}

}  // namespace ferry
