// InspectionService: the ferry.v1.Inspection gRPC service (inspection.proto):
// read-only views of the registry, the plans (via core/explain.h), version
// progress and the daemon's health. Owner: the Server. Threading: gRPC's
// sync server calls it from many threads; it reads the thread-safe
// components and keeps only its start time.
#ifndef FERRY_DAEMON_API_INSPECTION_SERVICE_H_
#define FERRY_DAEMON_API_INSPECTION_SERVICE_H_

#include <functional>
#include <string>
#include <utility>

#include "absl/time/time.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/registry.h"
#include "daemon/transfer/transfer_checksums.h"
#include "daemon/versions/version_coordinator.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"

namespace ferry {

class InspectionService final : public v1::Inspection::Service {
 public:
  // None is owned.
  InspectionService(const Registry* registry, PlanCache* plans,
                    const VersionCoordinator* coordinator, std::string node);

  // Fills GetHealth's role, coordinator_node, peers and problems (set
  // before serving; default: a single-node coordinator).
  void SetHealthFiller(
      std::function<void(v1::GetHealthResponse*)> fill_membership) {
    fill_membership_ = std::move(fill_membership);
  }

  grpc::Status ListParticipants(
      grpc::ServerContext* context,
      const v1::ListParticipantsRequest* request,
      v1::ListParticipantsResponse* response) override;
  grpc::Status ListStreams(grpc::ServerContext* context,
                           const v1::ListStreamsRequest* request,
                           v1::ListStreamsResponse* response) override;
  grpc::Status ExplainPlan(grpc::ServerContext* context,
                           const v1::ExplainPlanRequest* request,
                           v1::ExplainPlanResponse* response) override;
  grpc::Status GetProgress(grpc::ServerContext* context,
                           const v1::GetProgressRequest* request,
                           v1::GetProgressResponse* response) override;
  grpc::Status ListVersions(grpc::ServerContext* context,
                            const v1::ListVersionsRequest* request,
                            v1::ListVersionsResponse* response) override;
  grpc::Status GetHealth(grpc::ServerContext* context,
                         const v1::GetHealthRequest* request,
                         v1::GetHealthResponse* response) override;

  // VerifyInstance (inspection_verify.cc) compares with these (not owned;
  // set before serving; null: FAILED_PRECONDITION).
  void set_checksums(const TransferChecksums* checksums) {
    checksums_ = checksums;
  }
  grpc::Status VerifyInstance(grpc::ServerContext* context,
                              const v1::VerifyInstanceRequest* request,
                              v1::VerifyInstanceResponse* response) override;

 private:
  // The instance's status when it can be verified (idle at a committed
  // version), else FAILED_PRECONDITION / NOT_FOUND saying why.
  absl::StatusOr<v1::InstanceStatus> VerifiableStatus(
      const std::string& id) const;

  const Registry* const registry_;
  PlanCache* const plans_;
  const VersionCoordinator* const coordinator_;
  const std::string node_;
  const absl::Time started_ = absl::Now();
  std::function<void(v1::GetHealthResponse*)> fill_membership_;
  const TransferChecksums* checksums_ = nullptr;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_API_INSPECTION_SERVICE_H_
