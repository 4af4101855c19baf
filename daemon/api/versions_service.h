// VersionsService: the ferry.v1.Versions gRPC service (version.proto).
//
// Authenticates the handle with the Registry, checks the caller's role
// (sources begin, commit and abort; destinations subscribe and ack), and
// hands the call to the VersionCoordinator. Owner: the Server. Threading:
// gRPC's sync server calls it from many threads; Subscribe and
// CommitVersion block their thread while they wait. No state of its own.
#ifndef FERRY_DAEMON_API_VERSIONS_SERVICE_H_
#define FERRY_DAEMON_API_VERSIONS_SERVICE_H_

#include "daemon/registry/registry.h"
#include "daemon/versions/version_coordinator.h"
#include "proto/ferry/v1/version.grpc.pb.h"

namespace ferry {

class VersionsService final : public v1::Versions::Service {
 public:
  // Neither is owned.
  VersionsService(Registry* registry, VersionCoordinator* coordinator);

  grpc::Status BeginVersion(grpc::ServerContext* context,
                            const v1::BeginVersionRequest* request,
                            v1::BeginVersionResponse* response) override;
  grpc::Status CommitVersion(grpc::ServerContext* context,
                             const v1::CommitVersionRequest* request,
                             v1::CommitVersionResponse* response) override;
  grpc::Status AbortVersion(grpc::ServerContext* context,
                            const v1::AbortVersionRequest* request,
                            v1::AbortVersionResponse* response) override;
  grpc::Status Subscribe(grpc::ServerContext* context,
                         const v1::SubscribeRequest* request,
                         grpc::ServerWriter<v1::UpdateEvent>* writer) override;
  grpc::Status Ack(grpc::ServerContext* context, const v1::AckRequest* request,
                   v1::AckResponse* response) override;
  grpc::Status WaitForVersion(grpc::ServerContext* context,
                              const v1::WaitForVersionRequest* request,
                              v1::WaitForVersionResponse* response) override;

 private:
  // The participant behind a handle, which must have `role`.
  absl::StatusOr<std::shared_ptr<const Participant>> Caller(
      const v1::ParticipantHandle& handle, Role role, const char* rpc) const;

  Registry* const registry_;
  VersionCoordinator* const coordinator_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_API_VERSIONS_SERVICE_H_
