// PeerBoxHasher: RemoteBoxHasher over Peer.HashBoxes (transfer_checksums.h):
// the coordinator asks the member daemon that maps a participant's memory
// for the checksums of boxes in it.
//
// Owner: the Server. Threading: thread-safe (a channel per call).
#ifndef FERRY_DAEMON_TRANSFER_PEER_BOX_HASHER_H_
#define FERRY_DAEMON_TRANSFER_PEER_BOX_HASHER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/time/time.h"
#include "daemon/transfer/transfer_checksums.h"
#include "grpcpp/security/credentials.h"

namespace ferry {

class PeerBoxHasher : public RemoteBoxHasher {
 public:
  // `address_of` gives a live member's peer address ("" if none);
  // `timeout` bounds one call.
  // `credentials`: this daemon's mutual-TLS credentials for peers.
  PeerBoxHasher(std::function<std::string(const std::string&)> address_of,
                absl::Duration timeout,
                std::shared_ptr<grpc::ChannelCredentials> credentials);

  // UNAVAILABLE naming the node when it is not a live member or cannot be
  // reached; its error otherwise.
  absl::StatusOr<v1::HashBoxesResponse> HashBoxes(
      const std::string& node, const v1::HashBoxesRequest& request) override;

 private:
  const std::function<std::string(const std::string&)> address_of_;
  const absl::Duration timeout_;
  const std::shared_ptr<grpc::ChannelCredentials> credentials_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_PEER_BOX_HASHER_H_
