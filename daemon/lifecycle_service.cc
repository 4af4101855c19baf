#include "daemon/lifecycle_service.h"

#include <string>

namespace ferry {
namespace {

grpc::Status NotBuilt(const char* rpc, const char* issue) {
  return grpc::Status(
      grpc::StatusCode::UNIMPLEMENTED,
      std::string("Lifecycle.") + rpc + " is not built yet; it arrives with " +
          issue + " (designed in docs/api.md, \"Lifecycle (designed, not "
          "built)\")");
}

}  // namespace

grpc::Status LifecycleService::ReloadInPlace(grpc::ServerContext*,
                                             const v1::ReloadInPlaceRequest*,
                                             v1::ReloadInPlaceResponse*) {
  return NotBuilt("ReloadInPlace",
                  "the peer-instance delivery issue (bootstrap, reload, "
                  "repair from a peer instance)");
}
grpc::Status LifecycleService::SwapModel(grpc::ServerContext*,
                                         const v1::SwapModelRequest*,
                                         v1::SwapModelResponse*) {
  return NotBuilt("SwapModel", "the model swap issue (design §6, seed 004)");
}
grpc::Status LifecycleService::UpdateConfig(grpc::ServerContext*,
                                            const v1::UpdateConfigRequest*,
                                            v1::UpdateConfigResponse*) {
  return NotBuilt("UpdateConfig",
                  "the load options issue (design §6, seed 004)");
}
grpc::Status LifecycleService::LoadAdapter(grpc::ServerContext*,
                                           const v1::LoadAdapterRequest*,
                                           v1::LoadAdapterResponse*) {
  return NotBuilt("LoadAdapter", "the LoRA adapters issue (design §6, seed 003)");
}
grpc::Status LifecycleService::UpdateAdapter(grpc::ServerContext*,
                                             const v1::UpdateAdapterRequest*,
                                             v1::UpdateAdapterResponse*) {
  return NotBuilt("UpdateAdapter",
                  "the LoRA adapters issue (design §6, seed 003)");
}
grpc::Status LifecycleService::UnloadAdapter(grpc::ServerContext*,
                                             const v1::UnloadAdapterRequest*,
                                             v1::UnloadAdapterResponse*) {
  return NotBuilt("UnloadAdapter",
                  "the LoRA adapters issue (design §6, seed 003)");
}
grpc::Status LifecycleService::Offload(grpc::ServerContext*,
                                       const v1::OffloadRequest*,
                                       v1::OffloadResponse*) {
  return NotBuilt("Offload", "the offload/onload issue (design §6, seed 003)");
}
grpc::Status LifecycleService::Onload(grpc::ServerContext*,
                                      const v1::OnloadRequest*,
                                      v1::OnloadResponse*) {
  return NotBuilt("Onload", "the offload/onload issue (design §6, seed 003)");
}

}  // namespace ferry
