#include "daemon/transfer/route_receiver.h"

#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "glog/logging.h"

namespace ferry {
namespace {

// Channels one peer may hold into this daemon (one per route and
// transport; a cluster has a handful), and the length of their names.
constexpr int kMaxChannelsPerPeer = 16;
constexpr size_t kMaxChannelIdBytes = 512;
// A UCX_TLS list names a few transports; it only goes into messages here.
constexpr size_t kMaxTransportsBytes = 256;

std::string NewConnectionToken() {
  std::random_device rd;
  return absl::StrFormat("ferry-chan-%08x%08x%08x%08x", rd(), rd(), rd(),
                         rd());
}

}  // namespace

RouteReceiver::RouteReceiver(RouteOptions options, RouteMemory* memory,
                             RouteSender* sender)
    : options_(std::move(options)),
      memory_(memory),
      sender_(sender),
      quantizers_(memory, options_.devices),
      router_(options_.engine, options_.devices),
      factory_(ChannelFactoryOptionsOf(options_)) {}

RouteReceiver::~RouteReceiver() {
  // Fabric joins still running end by their own deadline.
  std::vector<std::shared_ptr<FabricJoin>> joins;
  {
    absl::MutexLock lock(&mu_);
    joins.swap(joins_);
  }
  for (auto& j : joins) {
    if (j->thread.joinable()) j->thread.join();
  }
}

std::shared_ptr<const MemoryMap> RouteReceiver::LocalMemory(
    const std::string& participant_id) {
  return memory_->LocalMemory(participant_id);
}

absl::Time RouteReceiver::DeadlineOf(
    const v1::RunTransferRequest& request) const {
  return absl::Now() + (request.timeout_ms() > 0
                            ? absl::Milliseconds(request.timeout_ms())
                            : options_.timeout);
}

absl::Status RouteReceiver::OpenChannel(const v1::OpenChannelRequest& request,
                                        v1::OpenChannelResponse* response) {
  if (request.caller_node().empty() || request.channel_id().empty() ||
      request.epoch() <= 0) {
    return absl::InvalidArgumentError(
        "OpenChannel: caller_node, channel_id and epoch > 0 are required");
  }
  if (request.has_nccl()) return OpenFabric(request);
  return OpenHost(request, response);
}

absl::Status RouteReceiver::OpenHost(const v1::OpenChannelRequest& request,
                                     v1::OpenChannelResponse* response) {
  // The kind, from the wire's oneof.
  const std::string kind =
      request.has_ucx() ? "ucx" : request.has_tcp() ? "tcp" : "";
  if (kind.empty()) {
    return absl::InvalidArgumentError(
        "OpenChannel: a transport (tcp, ucx or nccl) is required");
  }
  if (request.has_ucx() &&
      request.ucx().transports().size() > kMaxTransportsBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OpenChannel ucx: transports of ", request.ucx().transports().size(),
        " bytes (at most ", kMaxTransportsBytes, ")"));
  }
  const std::string token = NewConnectionToken();
  ChannelOffer offer;
  absl::StatusOr<std::unique_ptr<ChannelListener>> listener =
      factory_.Listen(kind, token, &offer);
  if (!listener.ok() && request.has_ucx()) {
    return absl::Status(
        listener.status().code(),
        absl::StrCat("OpenChannel ucx on node ", options_.node,
                     " (its transports \"", options_.ucx_transports,
                     "\", the caller's \"", request.ucx().transports(),
                     "\"): ", listener.status().message()));
  }
  if (!listener.ok()) return listener.status();
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Incoming*> fresh = NewEpochLocked(request);
  if (!fresh.ok()) return fresh.status();
  Incoming& in = **fresh;
  in.token = token;
  LOG(INFO) << "node " << request.caller_node() << " opens a " << kind
            << " channel into this node (" << request.channel_id()
            << ", epoch " << request.epoch() << ")";
  in.listener = *std::move(listener);
  response->mutable_tcp()->set_address(
      absl::StrCat(options_.host, ":", in.listener->port()));
  response->mutable_tcp()->set_connection_token(in.token);
  response->set_ucx_worker_address(offer.worker_address);
  return absl::OkStatus();
}

absl::StatusOr<RouteReceiver::Incoming*> RouteReceiver::NewEpochLocked(
    const v1::OpenChannelRequest& request) {
  // A peer's channels are named "<its node>-><route>", and it may hold a
  // few (one per route to this node and transport): every entry keeps a
  // listener's fd, so a caller cannot pile up more.
  const std::string prefix = absl::StrCat(request.caller_node(), "->");
  if (!absl::StartsWith(request.channel_id(), prefix) ||
      request.channel_id().size() > kMaxChannelIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OpenChannel: channel_id must be \"<caller_node>-><route>\" of at "
        "most ", kMaxChannelIdBytes, " bytes"));
  }
  if (incoming_.count(request.channel_id()) == 0) {
    int held = 0;
    for (auto it = incoming_.lower_bound(prefix);
         it != incoming_.end() && absl::StartsWith(it->first, prefix); ++it) {
      ++held;
    }
    if (held >= kMaxChannelsPerPeer) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "OpenChannel: node ", request.caller_node(), " already holds ",
          held, " channels into node ", options_.node, " (at most ",
          kMaxChannelsPerPeer, ")"));
    }
  }
  Incoming& in = incoming_[request.channel_id()];
  if (request.epoch() <= in.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenChannel: epoch ", request.epoch(), " of channel ",
        request.channel_id(), " is not greater than the live one, ",
        in.epoch));
  }
  // The lower epoch's channel goes (a fabric communicator is aborted).
  in = Incoming();
  in.epoch = request.epoch();
  return &in;
}

absl::Status RouteReceiver::OpenFabric(const v1::OpenChannelRequest& request) {
  const auto& setup = request.nccl();
  if (setup.unique_id().empty() || setup.world_size() != 2 ||
      setup.ranks_size() != 1 || setup.ranks(0).rank() != 1) {
    return absl::InvalidArgumentError(
        "OpenChannel nccl: a unique_id, world_size 2 and this daemon as "
        "rank 1 are required (the channels are two-rank communicators)");
  }
  const std::string& uuid = setup.ranks(0).cuda_uuid();
  DeviceMemory* devices = options_.devices;
  const int gpu = devices == nullptr ? -1 : devices->GpuOf(uuid);
  if (gpu < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenChannel nccl: node ", options_.node, " has no GPU ",
        uuid.empty() ? "at all" : uuid,
        devices == nullptr
            ? std::string()
            : absl::StrCat(" (", devices->Available().message(), ")")));
  }
  auto join = std::make_shared<FabricJoin>();
  absl::MutexLock lock(&mu_);
  // Reap the joins that ended.
  for (auto it = joins_.begin(); it != joins_.end();) {
    if ((*it)->done.HasBeenNotified()) {
      (*it)->thread.join();
      it = joins_.erase(it);
    } else {
      ++it;
    }
  }
  absl::StatusOr<Incoming*> fresh = NewEpochLocked(request);
  if (!fresh.ok()) return fresh.status();
  (*fresh)->fabric = join;
  // Joining blocks until the sender has joined too, which it does once
  // this call returns: so on a thread of its own.
  const ChannelFactory* factory = &factory_;
  const std::string id = setup.unique_id();
  const int64_t epoch = request.epoch();
  FabricJoin* j = join.get();
  join->thread = std::thread([j, factory, gpu, id, epoch] {
    j->channel = factory->JoinFabric(gpu, id, /*rank=*/1, epoch,
                                     absl::Now() + kFabricJoinTimeout);
    j->done.Notify();
  });
  joins_.push_back(std::move(join));
  return absl::OkStatus();
}

absl::Status RouteReceiver::RunTransfer(const v1::RunTransferRequest& request,
                                        const std::function<bool()>& cancelled,
                                        v1::RunTransferResponse* response) {
  if (request.role() == "send") return RunSend(request, cancelled, response);
  if (request.role() == "local") return RunLocal(request, cancelled, response);
  if (!request.role().empty() && request.role() != "receive") {
    return absl::InvalidArgumentError(
        absl::StrCat("RunTransfer: unknown role \"", request.role(), "\""));
  }
  return RunReceive(request, cancelled, response);
}

absl::Status RouteReceiver::Quantize(const v1::RunTransferRequest& request) {
  if (!request.has_quantize()) return absl::OkStatus();
  absl::Status s = quantizers_.Prepare(request.quantize());
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat("RunTransfer ", request.role(),
                                             " on node ", options_.node, ": ",
                                             s.message()));
}

absl::Status RouteReceiver::RunSend(const v1::RunTransferRequest& request,
                                    const std::function<bool()>& cancelled,
                                    v1::RunTransferResponse* response) {
  if (request.peer_node().empty() || request.peer_address().empty() ||
      request.send_size() != request.receive_size()) {
    return absl::InvalidArgumentError(
        "RunTransfer send: peer_node, peer_address and one send bucket per "
        "receive bucket are required");
  }
  const absl::Time deadline = DeadlineOf(request);
  absl::Status s = Quantize(request);
  if (!s.ok()) return s;
  RouteViews send;
  KeepAlive keep;
  s = memory_->ViewsOf(request, /*reserve=*/false,
                                    /*gpu_ok=*/request.has_nccl(), response,
                                    &send, nullptr, &keep);
  if (!s.ok()) return s;
  if (request.has_nccl()) {
    s = PinForFabric(send.places, options_.devices);
    if (!s.ok()) return s;
  }
  return sender_->SendRoute(request.peer_node(), request.peer_address(),
                            request, send.views, deadline, cancelled,
                            [](int64_t) {}, response);
}

absl::Status RouteReceiver::RunLocal(const v1::RunTransferRequest& request,
                                     const std::function<bool()>& cancelled,
                                     v1::RunTransferResponse* response) {
  if (request.send_size() != request.receive_size()) {
    return absl::InvalidArgumentError(
        "RunTransfer local: one send bucket per receive bucket is required");
  }
  absl::Status s = Quantize(request);
  if (!s.ok()) return s;
  RouteViews from, to;
  KeepAlive keep;
  s = memory_->ViewsOf(request, /*reserve=*/true,
                                    /*gpu_ok=*/true, response, &from, &to,
                                    &keep);
  if (!s.ok()) return s;
  absl::StatusOr<int64_t> copied =
      CopyViews(router_, from.views, from.places, to.views, to.places,
                cancelled, [](int64_t) {});
  if (!copied.ok()) {
    if (absl::IsCancelled(copied.status())) {
      return absl::CancelledError("RunTransfer cancelled by the caller");
    }
    return absl::Status(copied.status().code(),
                        absl::StrCat("RunTransfer local on node ",
                                     options_.node, ": ",
                                     copied.status().message()));
  }
  response->set_bytes_received(*copied);
  return absl::OkStatus();
}

absl::Status RouteReceiver::RunReceive(const v1::RunTransferRequest& request,
                                       const std::function<bool()>& cancelled,
                                       v1::RunTransferResponse* response) {
  const absl::Time deadline = DeadlineOf(request);
  std::unique_ptr<Channel> channel;
  std::unique_ptr<ChannelListener> listener;
  std::shared_ptr<FabricJoin> fabric;
  {
    absl::MutexLock lock(&mu_);
    auto it = incoming_.find(request.channel_id());
    if (it == incoming_.end() || it->second.epoch != request.channel_epoch()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "RunTransfer: no channel ", request.channel_id(), " at epoch ",
          request.channel_epoch(), " (open it with OpenChannel)"));
    }
    channel = std::move(it->second.channel);
    listener = std::move(it->second.listener);
    fabric = std::move(it->second.fabric);
  }
  RouteViews receive;
  KeepAlive keep;
  absl::Status s = memory_->ViewsOf(request, /*reserve=*/true,
                                    /*gpu_ok=*/request.has_nccl(), response,
                                    nullptr, &receive, &keep);
  if (!s.ok()) return s;
  if (request.has_nccl()) s = PinForFabric(receive.places, options_.devices);
  if (s.ok() && channel == nullptr && fabric == nullptr &&
      listener == nullptr) {
    return absl::FailedPreconditionError("RunTransfer: channel is busy");
  }
  if (s.ok() && channel == nullptr) {
    absl::StatusOr<std::unique_ptr<Channel>> c =
        ReceivingChannel(request, deadline, listener.get(), fabric.get());
    if (c.ok()) {
      channel = *std::move(c);
    } else {
      s = c.status();
    }
  }
  int64_t received = 0;
  for (const BucketView& view : receive.views) {
    if (!s.ok()) break;
    if (cancelled()) {
      s = absl::CancelledError("RunTransfer cancelled by the sender");
      break;
    }
    s = NameMemoryFault(channel->Receive(view, deadline));
    if (s.ok()) received += view.bytes;
  }
  response->set_bytes_received(received);
  absl::MutexLock lock(&mu_);
  auto it = incoming_.find(request.channel_id());
  if (s.ok() && it != incoming_.end() &&
      it->second.epoch == request.channel_epoch()) {
    it->second.channel = std::move(channel);  // kept for the next version
  } else if (!s.ok()) {
    LOG(WARNING) << "channel " << request.channel_id() << " epoch "
                 << request.channel_epoch() << " failed: " << s;
  }
  return s;
}

absl::StatusOr<std::unique_ptr<Channel>> RouteReceiver::ReceivingChannel(
    const v1::RunTransferRequest& request, absl::Time deadline,
    ChannelListener* listener, FabricJoin* fabric) {
  if (fabric != nullptr) {
    // The fabric channel OpenChannel began joining.
    if (!fabric->done.WaitForNotificationWithDeadline(deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "RunTransfer: the NCCL channel ", request.channel_id(),
          " was not joined by the deadline"));
    }
    if (!fabric->channel.ok()) return fabric->channel.status();
    return *std::move(fabric->channel);
  }
  while (true) {
    absl::StatusOr<std::unique_ptr<Channel>> c = listener->Accept(deadline);
    if (c.ok()) return c;
    // A connection without the token: closed; wait for the sender's.
    if (c.status().code() != absl::StatusCode::kPermissionDenied) return c;
    LOG(WARNING) << c.status();
  }
}

}  // namespace ferry
