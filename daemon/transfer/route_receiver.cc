#include "daemon/transfer/route_receiver.h"

#include <algorithm>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/transfer/delta_routes.h"
#include "daemon/transfer/rail_stripe.h"
#include "glog/logging.h"

namespace ferry {
namespace {

// Channels one peer may hold into this daemon (one per route, transport
// and rail; a cluster has a handful), and the length of their names.
constexpr int kMaxChannelsPerPeer = 2 * Limits::kMaxRails + 8;
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
  // A TCP channel listens on the rail the caller asks for (rail i of the
  // caller connects to rail i here).
  const int rails = std::max<int>(1, static_cast<int>(options_.rails.size()));
  const int rail = request.has_tcp()   ? request.tcp().rail()
                   : request.has_ucx() ? request.ucx().rail()
                                       : 0;
  if (rail < 0 || rail >= rails) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OpenChannel: rail ", rail, " of node ", options_.node,
        ", which has ", rails, rails == 1 ? " rail" : " rails"));
  }
  const std::string rail_host =
      options_.rails.empty() ? std::string() : options_.rails[rail];
  const std::string rail_device =
      rail < static_cast<int>(options_.rail_devices.size())
          ? options_.rail_devices[rail]
          : std::string();
  const std::string token = NewConnectionToken();
  ChannelOffer offer;
  absl::StatusOr<std::unique_ptr<ChannelListener>> listener =
      factory_.Listen(kind, token, rail_host, &offer, rail_device);
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
            << ", epoch " << request.epoch()
            << (rail_host.empty() ? std::string()
                                  : absl::StrCat(", rail ", rail, " at ",
                                                 rail_host))
            << ")";
  in.listener = *std::move(listener);
  response->mutable_tcp()->set_address(absl::StrCat(
      rail_host.empty() ? options_.host : rail_host, ":",
      in.listener->port()));
  response->set_rails(rails);
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

absl::StatusOr<v1::BlockAmaxResponse> RouteReceiver::BlockAmax(
    const v1::BlockAmaxRequest& request) {
  absl::StatusOr<v1::BlockAmaxResponse> r =
      quantizers_.BlockAmax(request.order());
  if (r.ok()) return r;
  return absl::Status(r.status().code(),
                      absl::StrCat("BlockAmax on node ", options_.node, ": ",
                                   r.status().message()));
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
                            request, send.views, send.places, deadline,
                            cancelled, [](int64_t) {}, response);
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
  // The route's channels: channel_id, then one per further rail, the
  // buckets striped over them (rail_stripe.h).
  std::vector<std::pair<std::string, int64_t>> ids = {
      {request.channel_id(), request.channel_epoch()}};
  for (const v1::RailChannel& rail : request.rail_channels()) {
    ids.emplace_back(rail.channel_id(), rail.epoch());
  }
  if (ids.size() > Limits::kMaxRails || (request.has_nccl() && ids.size() > 1)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "RunTransfer: ", ids.size(), " channels for one route (at most ",
        request.has_nccl() ? 1 : Limits::kMaxRails, ")"));
  }
  std::vector<Incoming> taken(ids.size());
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < ids.size(); ++i) {
      auto it = incoming_.find(ids[i].first);
      if (it == incoming_.end() || it->second.epoch != ids[i].second) {
        return absl::FailedPreconditionError(absl::StrCat(
            "RunTransfer: no channel ", ids[i].first, " at epoch ",
            ids[i].second, " (open it with OpenChannel)"));
      }
      for (size_t j = 0; j < i; ++j) {
        if (ids[j].first == ids[i].first) {
          return absl::InvalidArgumentError(absl::StrCat(
              "RunTransfer: channel ", ids[i].first, " named twice"));
        }
      }
    }
    for (size_t i = 0; i < ids.size(); ++i) {
      Incoming& in = incoming_[ids[i].first];
      taken[i].channel = std::move(in.channel);
      taken[i].listener = std::move(in.listener);
      taken[i].fabric = std::move(in.fabric);
    }
  }
  RouteViews receive;
  KeepAlive keep;
  absl::Status s = memory_->ViewsOf(request, /*reserve=*/true,
                                    /*gpu_ok=*/request.has_nccl(), response,
                                    nullptr, &receive, &keep);
  if (!s.ok()) return s;
  if (request.has_nccl()) s = PinForFabric(receive.places, options_.devices);
  std::vector<Channel*> channels;
  for (Incoming& in : taken) {
    if (!s.ok()) break;
    if (in.channel == nullptr && in.fabric == nullptr &&
        in.listener == nullptr) {
      return absl::FailedPreconditionError("RunTransfer: channel is busy");
    }
    if (in.channel == nullptr) {
      absl::StatusOr<std::unique_ptr<Channel>> c = ReceivingChannel(
          request, deadline, in.listener.get(), in.fabric.get());
      if (!c.ok()) {
        s = c.status();
        break;
      }
      in.channel = *std::move(c);
    }
    channels.push_back(in.channel.get());
  }
  int64_t received = 0;
  if (s.ok() && request.delta()) {
    // Each bucket as its form says: dense, or a patch (delta_routes.h).
    DeltaCounts counts;
    const std::string what = absl::StrCat("route ", request.channel_id());
    s = RunStriped(
        channels, receive.views, cancelled,
        [&](Channel& c, size_t i) {
          return ReceiveDelta(c, receive.views[i], deadline, &counts, what);
        },
        nullptr, nullptr, &received);
    counts.AddTo(response);
  } else if (s.ok()) {
    s = ReceiveStriped(channels, receive.views, deadline, cancelled,
                       &received);
  }
  if (absl::IsCancelled(s)) {
    s = absl::CancelledError("RunTransfer cancelled by the sender");
  }
  response->set_bytes_received(received);
  absl::MutexLock lock(&mu_);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto it = incoming_.find(ids[i].first);
    if (s.ok() && it != incoming_.end() &&
        it->second.epoch == ids[i].second) {
      it->second.channel = std::move(taken[i].channel);  // for the next one
    }
  }
  if (!s.ok()) {
    LOG(WARNING) << "channel " << request.channel_id() << " epoch "
                 << request.channel_epoch()
                 << (ids.size() > 1
                         ? absl::StrCat(" (and ", ids.size() - 1,
                                        " more rails)")
                         : std::string())
                 << " failed: " << s;
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
