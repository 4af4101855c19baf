#include "daemon/transfer/peer_box_hasher.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "proto/grpc_status.h"

namespace ferry {

PeerBoxHasher::PeerBoxHasher(
    std::function<std::string(const std::string&)> address_of,
    absl::Duration timeout,
    std::shared_ptr<grpc::ChannelCredentials> credentials)
    : address_of_(std::move(address_of)),
      timeout_(timeout),
      credentials_(std::move(credentials)) {}

absl::StatusOr<v1::HashBoxesResponse> PeerBoxHasher::HashBoxes(
    const std::string& node, const v1::HashBoxesRequest& request) {
  const std::string address = address_of_ ? address_of_(node) : "";
  if (address.empty()) {
    return absl::UnavailableError(
        absl::StrCat("node ", node, " is not a live member"));
  }
  // Mutual TLS, as every call between daemons (docs/api.md).
  auto stub = v1::Peer::NewStub(grpc::CreateChannel(address, credentials_));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout_));
  v1::HashBoxesResponse response;
  grpc::Status s = stub->HashBoxes(&ctx, request, &response);
  if (!s.ok()) {
    return absl::Status(FromGrpcStatus(s).code(),
                        absl::StrCat("node ", node, " HashBoxes: ",
                                     s.error_message()));
  }
  return response;
}

}  // namespace ferry
