#include "transport/channel_factory.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/ucx/ucx_channel.h"

namespace ferry {

ChannelFactory::ChannelFactory(ChannelFactoryOptions options)
    : options_(std::move(options)) {}

bool ChannelFactory::IsHostKind(absl::string_view kind) {
  return kind == "tcp" || kind == "ucx";
}

absl::StatusOr<std::unique_ptr<ChannelListener>> ChannelFactory::Listen(
    absl::string_view kind, const std::string& token, const std::string& host,
    ChannelOffer* offer, const std::string& device) const {
  const std::string& bind = host.empty() ? options_.listen_host : host;
  if (kind == "ucx") {
    UcxChannelOptions options;
    options.transports = options_.ucx_transports;
    options.net_devices = device;
    options.connection_token = token;
    absl::StatusOr<std::unique_ptr<UcxListener>> ucx =
        ListenUcx(bind, 0, options);
    if (!ucx.ok()) return ucx.status();
    offer->port = (*ucx)->port();
    offer->worker_address = (*ucx)->worker_address();
    return std::unique_ptr<ChannelListener>(*std::move(ucx));
  }
  if (kind == "tcp") {
    TcpChannelOptions options;
    options.connection_token = token;
    options.socket.dead_after = options_.dead_after;
    absl::StatusOr<std::unique_ptr<ChannelListener>> tcp =
        ListenTcp(bind, 0, options);
    if (!tcp.ok()) return tcp.status();
    offer->port = (*tcp)->port();
    offer->worker_address.clear();
    return tcp;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no listening end for channels of kind \"", kind, "\""));
}

absl::StatusOr<std::unique_ptr<Channel>> ChannelFactory::Connect(
    absl::string_view kind, const std::string& host, const ChannelOffer& offer,
    const std::string& token, absl::Time deadline,
    const std::string& local_host, const std::string& device) const {
  if (kind == "ucx") {
    UcxChannelOptions options;
    options.transports = options_.ucx_transports;
    options.net_devices = device;
    options.connection_token = token;
    options.socket.local_host = local_host;
    return ConnectUcxChannel(host, offer.port, offer.worker_address, deadline,
                             options);
  }
  if (kind == "tcp") {
    TcpChannelOptions options;
    options.connection_token = token;
    options.socket.dead_after = options_.dead_after;
    options.socket.local_host = local_host;
    return ConnectTcpChannel(host, offer.port, deadline, options);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("no connecting end for channels of kind \"", kind, "\""));
}

absl::StatusOr<std::string> ChannelFactory::OfferFabric() const {
  if (options_.devices == nullptr) {
    return absl::FailedPreconditionError("no GPUs for an nccl channel");
  }
  return options_.devices->NewFabricId();
}

absl::StatusOr<std::unique_ptr<Channel>> ChannelFactory::JoinFabric(
    int gpu, const std::string& id, int rank, int64_t epoch,
    absl::Time deadline) const {
  if (options_.devices == nullptr) {
    return absl::FailedPreconditionError("no GPUs for an nccl channel");
  }
  return options_.devices->JoinFabric(gpu, id, rank, epoch, deadline);
}

}  // namespace ferry
