// RegistryService: the ferry.v1.Registry gRPC service (registration.proto).
//
// Runs each registration's four steps (limits, conversion, core check,
// mapping: registration_parser.h; RegisterSource and RegisterDestination
// share everything around them, Register), adds it to the Registry, and
// converts every absl::Status into the gRPC status of docs/api.md's error
// model. Owner: the Server. Threading: gRPC's sync
// server calls it from many threads; it keeps no state of its own.
#ifndef FERRY_DAEMON_API_REGISTRY_SERVICE_H_
#define FERRY_DAEMON_API_REGISTRY_SERVICE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/memory/memory_map.h"
#include "daemon/registry/participant.h"
#include "daemon/registry/registry.h"
#include "daemon/security/caller_identity.h"
#include "proto/ferry/v1/registration.grpc.pb.h"
#include "transport/device_memory.h"

namespace ferry {

class RegistryService final : public v1::Registry::Service {
 public:
  // `node`: this daemon's node name. `registry` and `devices` (which maps
  // CUDA IPC regions) are not owned.
  // `coordinator_address` non-empty: this daemon is a member; the Server
  // then serves ForwardingRegistryService (forwarding.h) instead, and this
  // service, if called, refuses with FAILED_PRECONDITION naming the
  // coordinator.
  // `callers` (not owned) says who registers: memory is mapped with the
  // unix caller's rights, never for a TCP caller.
  RegistryService(Registry* registry, std::string node, DeviceMemory* devices,
                  const CallerIdentity* callers,
                  std::string coordinator_address = "");

  grpc::Status RegisterSource(grpc::ServerContext* context,
                              const v1::RegisterSourceRequest* request,
                              v1::RegisterSourceResponse* response) override;
  grpc::Status RegisterDestination(
      grpc::ServerContext* context,
      const v1::RegisterDestinationRequest* request,
      v1::RegisterDestinationResponse* response) override;
  grpc::Status Deregister(grpc::ServerContext* context,
                          const v1::DeregisterRequest* request,
                          v1::DeregisterResponse* response) override;
  grpc::Status Heartbeat(grpc::ServerContext* context,
                         const v1::HeartbeatRequest* request,
                         v1::HeartbeatResponse* response) override;
  grpc::Status HeartbeatBatch(grpc::ServerContext* context,
                              const v1::HeartbeatBatchRequest* request,
                              v1::HeartbeatBatchResponse* response) override;
  grpc::Status UpdateRegions(grpc::ServerContext* context,
                             const v1::UpdateRegionsRequest* request,
                             v1::UpdateRegionsResponse* response) override;

  // Says whether a destination's regions may change now: "" or why not
  // (OffloadRuns::RegionsFixed). Set before serving; unset, every
  // UpdateRegions is FAILED_PRECONDITION.
  using RegionsGate = std::function<std::string(const Participant&)>;
  void set_regions_gate(RegionsGate gate) { regions_gate_ = std::move(gate); }

 private:
  RegionsGate regions_gate_;
  Registry* const registry_;
  const std::string node_;
  DeviceMemory* const devices_;
  const CallerIdentity* const callers_;
  const std::string coordinator_address_;
  absl::Status RefuseOnMember() const;

  // A registration's four steps (ParseSourceRegistration or
  // ParseDestinationRegistration), given the caller's mapping rights.
  using Walk = std::function<absl::StatusOr<std::unique_ptr<Participant>>(
      const MapOptions& mapping)>;
  // What RegisterSource and RegisterDestination share: the mapping rights,
  // the walk, the owner (destinations), the deadline, Registry::Add, and
  // the handle and lease (in milliseconds) to answer with.
  grpc::Status Register(grpc::ServerContext* context, Role role,
                        const Walk& walk, bool replace_existing,
                        v1::ParticipantHandle* handle, int64_t* lease_ms);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_API_REGISTRY_SERVICE_H_
