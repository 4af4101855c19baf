// LifecycleService: the ferry.v1.Lifecycle gRPC service (lifecycle.proto),
// designed but not built: every RPC answers UNIMPLEMENTED, saying which
// piece of work brings it (docs/api.md, "Lifecycle (designed, not built)").
// Owner: the Server. Threading: stateless.
#ifndef FERRY_DAEMON_LIFECYCLE_SERVICE_H_
#define FERRY_DAEMON_LIFECYCLE_SERVICE_H_

#include "proto/ferry/v1/lifecycle.grpc.pb.h"

namespace ferry {

class LifecycleService final : public v1::Lifecycle::Service {
 public:
  grpc::Status ReloadInPlace(grpc::ServerContext*,
                             const v1::ReloadInPlaceRequest*,
                             v1::ReloadInPlaceResponse*) override;
  grpc::Status SwapModel(grpc::ServerContext*, const v1::SwapModelRequest*,
                         v1::SwapModelResponse*) override;
  grpc::Status UpdateConfig(grpc::ServerContext*,
                            const v1::UpdateConfigRequest*,
                            v1::UpdateConfigResponse*) override;
  grpc::Status LoadAdapter(grpc::ServerContext*, const v1::LoadAdapterRequest*,
                           v1::LoadAdapterResponse*) override;
  grpc::Status UpdateAdapter(grpc::ServerContext*,
                             const v1::UpdateAdapterRequest*,
                             v1::UpdateAdapterResponse*) override;
  grpc::Status UnloadAdapter(grpc::ServerContext*,
                             const v1::UnloadAdapterRequest*,
                             v1::UnloadAdapterResponse*) override;
  grpc::Status Offload(grpc::ServerContext*, const v1::OffloadRequest*,
                       v1::OffloadResponse*) override;
  grpc::Status Onload(grpc::ServerContext*, const v1::OnloadRequest*,
                      v1::OnloadResponse*) override;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_LIFECYCLE_SERVICE_H_
