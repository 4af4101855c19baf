#include "daemon/transfer/peer_channels.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/channel_args.h"

namespace ferry {

PeerChannels::PeerChannels(
    std::shared_ptr<grpc::ChannelCredentials> credentials)
    : credentials_(std::move(credentials)) {}

std::shared_ptr<grpc::Channel> PeerChannels::For(const std::string& address) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<grpc::Channel>& channel = channels_[address];
  if (channel == nullptr) {
    channel = grpc::CreateCustomChannel(address, credentials_,
                                        QuickReconnectArgs());
  }
  return channel;
}

absl::Status PeerChannels::Connected(const std::string& node,
                                     const std::string& address,
                                     absl::Time deadline,
                                     const std::function<bool()>& cancelled) {
  std::shared_ptr<grpc::Channel> channel = For(address);
  // gRPC retries a failed connection attempt on its own (backoff 100 ms to
  // 1 s); waiting for READY rides over the failed attempts. In slices, so
  // that a cancelled transfer stops waiting.
  const absl::Time start = absl::Now();
  const absl::Time until = std::min(deadline, start + kConnectBudget);
  while (true) {
    const absl::Time slice = std::min(until, absl::Now() + absl::Milliseconds(50));
    if (channel->WaitForConnected(absl::ToChronoTime(slice))) {
      return absl::OkStatus();
    }
    if (cancelled && cancelled()) return absl::CancelledError("cancelled");
    if (absl::Now() >= until) break;
  }
  return absl::UnavailableError(absl::StrCat(
      "node ", node, " at ", address, " could not be reached in ",
      absl::FormatDuration(absl::Now() - start),
      " (every connection attempt failed or timed out)"));
}

}  // namespace ferry
