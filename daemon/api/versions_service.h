// VersionsService: the ferry.v1.Versions gRPC service (version.proto).
//
// Authenticates the handle with the Registry, checks the caller's role
// (sources begin, commit and abort; destinations subscribe and ack), and
// hands the call to the VersionCoordinator. Owner: the Server. Threading:
// gRPC's sync server calls it from many threads. Two calls hold no thread
// while they wait: CommitVersion (answered when its version settles) and
// Subscribe, a callback stream (subscribe_stream.h). Destroy it after the gRPC
// server has shut down.
#ifndef FERRY_DAEMON_API_VERSIONS_SERVICE_H_
#define FERRY_DAEMON_API_VERSIONS_SERVICE_H_

#include "daemon/api/subscribe_stream.h"
#include "daemon/registry/registry.h"
#include "daemon/versions/version_coordinator.h"
#include "proto/ferry/v1/version.grpc.pb.h"

namespace ferry {

class VersionsService final
    : public v1::Versions::WithCallbackMethod_CommitVersion<
          v1::Versions::WithCallbackMethod_Subscribe<
              v1::Versions::WithCallbackMethod_SubscribeRelay<
                  v1::Versions::Service>>> {
 public:
  // Neither is owned.
  VersionsService(Registry* registry, VersionCoordinator* coordinator);

  grpc::Status BeginVersion(grpc::ServerContext* context,
                            const v1::BeginVersionRequest* request,
                            v1::BeginVersionResponse* response) override;
  // Answered when the version settles, from the thread that settles it.
  grpc::ServerUnaryReactor* CommitVersion(
      grpc::CallbackServerContext* context,
      const v1::CommitVersionRequest* request,
      v1::CommitVersionResponse* response) override;
  grpc::Status AbortVersion(grpc::ServerContext* context,
                            const v1::AbortVersionRequest* request,
                            v1::AbortVersionResponse* response) override;
  grpc::ServerWriteReactor<v1::UpdateEvent>* Subscribe(
      grpc::CallbackServerContext* context,
      const v1::SubscribeRequest* request) override;
  // A member's ranks' subscriptions on one stream (subscribe_relay_stream.h).
  grpc::ServerBidiReactor<v1::SubscribeRelayRequest,
                          v1::SubscribeRelayResponse>*
  SubscribeRelay(grpc::CallbackServerContext* context) override;
  grpc::Status Ack(grpc::ServerContext* context, const v1::AckRequest* request,
                   v1::AckResponse* response) override;
  grpc::Status AckBatch(grpc::ServerContext* context,
                        const v1::AckBatchRequest* request,
                        v1::AckBatchResponse* response) override;
  grpc::Status WaitForVersion(grpc::ServerContext* context,
                              const v1::WaitForVersionRequest* request,
                              v1::WaitForVersionResponse* response) override;

 private:
  // One ack, checked and applied (Ack, and each of AckBatch's).
  absl::Status AckOne(const v1::AckRequest& request) const;
  // The participant behind a handle, which must have `role`.
  absl::StatusOr<std::shared_ptr<const Participant>> Caller(
      const v1::ParticipantHandle& handle, Role role, const char* rpc) const;

  Registry* const registry_;
  VersionCoordinator* const coordinator_;
  SubscriptionPump pump_;  // wakes Subscribe streams
};

}  // namespace ferry

#endif  // FERRY_DAEMON_API_VERSIONS_SERVICE_H_
