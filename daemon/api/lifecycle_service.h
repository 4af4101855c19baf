// LifecycleService: the ferry.v1.Lifecycle gRPC service (lifecycle.proto).
// ReloadInPlace (a peer delivery, version_coordinator.h), SwapModel
// (model_swaps.h), UpdateConfig (load_options.h, kept by the Registry),
// Offload and Onload (offloads.cc) and the LoRA adapter calls
// (adapters.h) are built. On a member daemon every call is
// FAILED_PRECONDITION
// naming the coordinator, which runs the protocol. ReloadInPlace,
// Offload, Onload, the adapter calls and UpdateConfig (when it changes
// something) are for the
// user that registered the instance's ranks, or root, or an operator over
// TCP (docs/api.md, "Authentication"); SwapModel is authorized by each
// rank's own handle.
// Owner: the Server. Threading: stateless; handlers run on gRPC threads.
#ifndef FERRY_DAEMON_API_LIFECYCLE_SERVICE_H_
#define FERRY_DAEMON_API_LIFECYCLE_SERVICE_H_

#include <string>
#include <utility>

#include "absl/time/time.h"
#include "daemon/lifecycle/adapters.h"
#include "daemon/lifecycle/model_swaps.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/registry.h"
#include "daemon/security/caller_identity.h"
#include "daemon/versions/version_coordinator.h"
#include "proto/ferry/v1/lifecycle.grpc.pb.h"
#include "transport/device_memory.h"

namespace ferry {

class LifecycleService final : public v1::Lifecycle::Service {
 public:
  struct Options {
    std::string node;                 // this daemon's node name
    std::string coordinator_address;  // empty: this daemon coordinates
    absl::Duration swap_wait = absl::Minutes(2);  // ModelSwaps' wait
    // Adapters' staging on members' nodes (Adapters::Options).
    ManageRemoteMemory remote_memory;
  };
  // Not owned. `callers` and `devices` map a SwapModel's new memory as
  // registrations are mapped (caller_identity.h).
  LifecycleService(Registry* registry, PlanCache* plans,
                   VersionCoordinator* coordinator,
                   const CallerIdentity* callers, DeviceMemory* devices,
                   Options options)
      : registry_(registry),
        plans_(plans),
        coordinator_(coordinator),
        callers_(callers),
        devices_(devices),
        options_(std::move(options)),
        swaps_(registry, coordinator, options_.swap_wait),
        adapters_(registry, plans, coordinator,
                  Adapters::Options{options_.node, options_.swap_wait,
                                    options_.remote_memory}) {}

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

 private:
  // PERMISSION_DENIED unless the caller may change the instance: root or
  // a TCP operator (mutual TLS), or the uid that registered every rank.
  absl::Status MayChange(const grpc::ServerContext& context,
                         const std::string& instance_id, const char* rpc) const;
  // FAILED_PRECONDITION naming the coordinator on a member daemon.
  absl::Status RefuseOnMember(const char* rpc) const;
  // The checks every call on one instance makes (RefuseOnMember, the name,
  // the instance registered, MayChange): the stream it follows, or why not.
  absl::StatusOr<std::string> StreamToChange(const grpc::ServerContext& context,
                                             const std::string& instance_id,
                                             const char* rpc) const;

  Registry* const registry_;
  PlanCache* const plans_;
  VersionCoordinator* const coordinator_;
  const CallerIdentity* const callers_;
  DeviceMemory* const devices_;
  const Options options_;
  ModelSwaps swaps_;
  Adapters adapters_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_API_LIFECYCLE_SERVICE_H_
