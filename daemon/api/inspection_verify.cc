// InspectionService::VerifyInstance (inspection.proto): the preconditions
// and the comparison of transfer_checksums.h.
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/api/inspection_service.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"

namespace ferry {
namespace {

const char* StateName(v1::InstanceState state) {
  switch (state) {
    case v1::INSTANCE_STATE_PREPARE:
      return "PREPARE";
    case v1::INSTANCE_STATE_PAUSED:
      return "PAUSED";
    case v1::INSTANCE_STATE_TRANSFER:
      return "TRANSFER";
    case v1::INSTANCE_STATE_APPLY:
      return "APPLY";
    default:
      return "?";
  }
}

bool SameStatus(const v1::InstanceStatus& a, const v1::InstanceStatus& b) {
  return a.state() == b.state() && a.version() == b.version() &&
         a.committed_version() == b.committed_version() &&
         a.dirty() == b.dirty();
}

}  // namespace

absl::StatusOr<v1::InstanceStatus> InspectionService::VerifiableStatus(
    const std::string& id) const {
  absl::StatusOr<std::string> stream = registry_->StreamOfInstance(id);
  if (!stream.ok()) return stream.status();
  absl::StatusOr<Registry::StreamSnapshot> snap = registry_->Snapshot(*stream);
  if (!snap.ok()) return snap.status();
  int64_t held = 0;
  for (const Registry::InstanceMembers& m : snap->instances) {
    if (m.id == id) held = m.held_version;
  }
  v1::InstanceStatus status = coordinator_->InstanceStatusOf(id, held);
  switch (status.state()) {
    case v1::INSTANCE_STATE_PREPARE:
    case v1::INSTANCE_STATE_PAUSED:
    case v1::INSTANCE_STATE_TRANSFER:
    case v1::INSTANCE_STATE_APPLY:
      return absl::FailedPreconditionError(absl::StrCat(
          "instance ", id, ": version ", status.version(),
          " is in progress (", StateName(status.state()),
          "); verify once it has settled"));
    case v1::INSTANCE_STATE_OFFLOADED:
      return absl::FailedPreconditionError(
          absl::StrCat("instance ", id, " is offloaded"));
    default:
      break;
  }
  if (status.dirty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "instance ", id, " is dirty: version ", status.version(),
        " aborted after its transfer began (", status.abort_reason(),
        "), so its live buffers hold neither that version nor version ",
        status.committed_version()));
  }
  return status;
}

grpc::Status InspectionService::VerifyInstance(
    grpc::ServerContext*, const v1::VerifyInstanceRequest* request,
    v1::VerifyInstanceResponse* response) {
  const std::string& id = request->instance_id();
  if (absl::Status s = ValidateName("instance_id", id); !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<v1::InstanceStatus> before = VerifiableStatus(id);
  if (!before.ok()) return ToGrpcStatus(before.status());
  if (checksums_ == nullptr || !checksums_->enabled()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "instance ", id, ": this ferryd runs without --transfer_checksums "
        "(off by default), so it keeps no checksums to compare with; start "
        "it with --transfer_checksums, and the next version it delivers "
        "can be verified")));
  }
  std::shared_ptr<const InstanceChecksums> sums = checksums_->Latest(id);
  if (sums == nullptr) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "instance ", id, ": no checksums kept for version ",
        before->committed_version(),
        ": checksums are taken while this ferryd delivers a version and "
        "kept in memory, and it has not delivered one to this instance "
        "since it started (or since the instance registered)")));
  }
  if (sums->version != before->committed_version()) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "instance ", id, " holds version ", before->committed_version(),
        " but the checksums kept are of version ", sums->version)));
  }
  absl::StatusOr<v1::VerifyInstanceResponse> result = checksums_->Verify(*sums);
  if (!result.ok()) return ToGrpcStatus(result.status());
  // A version that began meanwhile may have changed the bytes under the
  // hashing: the comparison says nothing then.
  absl::StatusOr<v1::InstanceStatus> after = VerifiableStatus(id);
  if (!after.ok() || !SameStatus(*before, *after)) {
    return ToGrpcStatus(absl::AbortedError(absl::StrCat(
        "instance ", id, ": a version began while verifying version ",
        sums->version, "; run it again once it has settled")));
  }
  *response = *std::move(result);
  return grpc::Status::OK;
}

}  // namespace ferry
