#include "daemon/transfer/outgoing_channels.h"

#include <algorithm>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"

namespace ferry {
namespace {

constexpr char kFabricSuffix[] = "#nccl";  // fabric channels: "<node>#nccl"

bool SplitHostPort(const std::string& address, std::string* host,
                   int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  *host = address.substr(0, colon);
  if (host->size() >= 2 && (*host)[0] == '[') {
    *host = host->substr(1, host->size() - 2);
  }
  return absl::SimpleAtoi(address.substr(colon + 1), port);
}

// The kept map's key of rail `rail` of a route to `node` of `kind`.
std::string KeyOf(const std::string& node, const std::string& kind,
                  int rail) {
  if (kind == "nccl") return node + kFabricSuffix;
  return rail == 0 ? node : absl::StrCat(node, "/rail", rail);
}

}  // namespace

bool NodesCover(const std::string& nodes, const std::string& node) {
  if (nodes == "*") return true;
  for (absl::string_view name : absl::StrSplit(nodes, ',')) {
    if (name == node) return true;
  }
  return false;
}

bool RouteChannels::any_kept() const {
  for (const One& one : channels) {
    if (one.kept) return true;
  }
  return false;
}

std::vector<Channel*> RouteChannels::raw() const {
  std::vector<Channel*> out;
  for (const One& one : channels) out.push_back(one.channel.get());
  return out;
}

void RouteChannels::Describe(v1::RunTransferRequest* req) const {
  req->clear_rail_channels();
  for (size_t i = 0; i < channels.size(); ++i) {
    if (i == 0) {
      req->set_channel_id(channels[i].channel_id);
      req->set_channel_epoch(channels[i].epoch);
      continue;
    }
    v1::RailChannel* rail = req->add_rail_channels();
    rail->set_channel_id(channels[i].channel_id);
    rail->set_epoch(channels[i].epoch);
  }
}

OutgoingChannels::OutgoingChannels(const RouteOptions& options,
                                   PeerChannels* peers)
    : options_(options),
      peers_(peers),
      factory_(ChannelFactoryOptionsOf(options_)) {}

OutgoingChannels::Claim::~Claim() {
  absl::MutexLock lock(&owner_->mu_);
  owner_->kept_[key_].in_use = false;
}

std::string OutgoingChannels::KindOf(const std::string& node,
                                     const v1::RunTransferRequest& req) const {
  if (req.has_nccl()) return "nccl";
  return NodesCover(options_.ucx_nodes, node) ? "ucx" : "tcp";
}

void OutgoingChannels::ForgetNode(const std::string& node) {
  std::vector<std::unique_ptr<Channel>> doomed;
  absl::MutexLock lock(&mu_);
  for (auto& [key, kept] : kept_) {
    if (key != node && key.rfind(node + "#", 0) != 0 &&
        key.rfind(node + "/", 0) != 0) {
      continue;
    }
    doomed.push_back(std::move(kept.channel));
    ++kept.epoch;  // a transfer in flight does not put its channel back
    kept.peer_rails = 0;
    kept.rest_until = absl::InfinitePast();
  }
}

absl::StatusOr<std::unique_ptr<OutgoingChannels::Claim>>
OutgoingChannels::ClaimFor(const std::string& node,
                           const v1::RunTransferRequest& req,
                           absl::Time deadline,
                           const std::function<bool()>& cancelled) {
  const std::string key = KeyOf(node, KindOf(node, req), 0);
  // Several instances' transfers run at once: one route per channel.
  absl::MutexLock lock(&mu_);
  auto free = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !kept_[key].in_use;
  };
  while (!mu_.AwaitWithTimeout(absl::Condition(&free),
                               absl::Milliseconds(50))) {
    if (cancelled()) return absl::CancelledError("cancelled");
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "channel ", options_.node, "->", key,
          " stayed busy with other routes until the transfer's deadline"));
    }
  }
  kept_[key].in_use = true;
  return std::make_unique<Claim>(this, key);
}

absl::StatusOr<RouteChannels> OutgoingChannels::Take(
    const std::string& node, const std::string& address,
    const v1::RunTransferRequest& req, absl::Time deadline) {
  const std::string kind = KindOf(node, req);
  // Host kinds go over every rail; a fabric (NCCL) picks its own NICs.
  const int here =
      kind != "nccl"
          ? std::max<int>(1, static_cast<int>(options_.rails.size()))
          : 1;
  RouteChannels out;
  absl::Status last;
  int rails = here;
  for (int rail = 0; rail < rails; ++rail) {
    const std::string key = KeyOf(node, kind, rail);
    {
      absl::MutexLock lock(&mu_);
      const int peer = kept_[KeyOf(node, kind, 0)].peer_rails;
      if (peer > 0) rails = std::min(here, peer);
      if (rail >= rails) break;
      // A rail that would not open rests, unless no other opened.
      const bool last_chance = out.channels.empty() && rail + 1 == rails;
      if (kept_[key].rest_until > absl::Now() && !last_chance) continue;
    }
    const absl::Time until =
        here > 1 ? std::min(deadline, absl::Now() + kRailConnectBudget)
                 : deadline;
    absl::StatusOr<RouteChannels::One> one =
        TakeOne(node, address, key, rail, req, until);
    if (one.ok()) {
      out.channels.push_back(*std::move(one));
      continue;
    }
    last = one.status();
    if (here == 1) return last;
    LOG(WARNING) << "rail " << rail << " to node " << node
                 << " left out for "
                 << absl::FormatDuration(kRailRestAfterFailure) << ": "
                 << last;
    absl::MutexLock lock(&mu_);
    kept_[key].rest_until = absl::Now() + kRailRestAfterFailure;
  }
  if (out.channels.empty()) {
    return last.ok() ? absl::UnavailableError(absl::StrCat(
                           "no rail to node ", node, " would open"))
                     : last;
  }
  return out;
}

absl::StatusOr<RouteChannels::One> OutgoingChannels::TakeOne(
    const std::string& node, const std::string& address,
    const std::string& key, int rail, const v1::RunTransferRequest& req,
    absl::Time deadline) {
  RouteChannels::One one;
  one.key = key;
  one.rail = rail;
  one.channel_id = absl::StrCat(options_.node, "->", key);
  bool first_open = false;
  {
    absl::MutexLock lock(&mu_);
    Kept& kept = kept_[key];
    one.channel = std::move(kept.channel);
    first_open = kept.epoch == 0;
    if (kept.epoch == 0) kept.epoch = absl::ToUnixMicros(absl::Now());
    if (one.channel == nullptr) ++kept.epoch;
    one.epoch = kept.epoch;
  }
  one.kept = one.channel != nullptr;
  if (one.kept) return one;
  const std::string kind = KindOf(node, req);
  int peer_rails = 0;
  absl::StatusOr<std::unique_ptr<Channel>> c =
      Connect(node, address, one.channel_id, one.epoch, rail, req, deadline,
              &peer_rails);
  if (peer_rails > 0) {
    absl::MutexLock lock(&mu_);
    kept_[KeyOf(node, kind, 0)].peer_rails = peer_rails;
  }
  if (!c.ok()) return c.status();
  one.channel = *std::move(c);
  LOG(INFO) << "opened a " << kind << " channel to node " << node
            << (options_.rails.size() > 1 ? absl::StrCat(" on rail ", rail)
                                          : std::string())
            << " (epoch " << one.epoch << ")";
  if (options_.metrics != nullptr) {
    options_.metrics->ChannelOpened(kind, first_open);
  }
  return one;
}

void OutgoingChannels::Keep(RouteChannels channels) {
  absl::MutexLock lock(&mu_);
  for (RouteChannels::One& one : channels.channels) {
    Kept& kept = kept_[one.key];
    if (kept.epoch == one.epoch) kept.channel = std::move(one.channel);
  }
}

absl::StatusOr<std::unique_ptr<Channel>> OutgoingChannels::Connect(
    const std::string& node, const std::string& address,
    const std::string& channel_id, int64_t epoch, int rail,
    const v1::RunTransferRequest& route, absl::Time deadline,
    int* peer_rails) {
  const std::string kind = KindOf(node, route);
  v1::OpenChannelRequest req;
  req.set_caller_node(options_.node);
  req.set_channel_id(channel_id);
  req.set_epoch(epoch);
  std::string fabric_id;
  int gpu = -1;
  if (kind == "nccl") {
    // The sender's GPU joins as rank 0, the receiver's as rank 1.
    const std::string& sender_gpu = route.nccl().sender_cuda_uuid();
    DeviceMemory* devices = options_.devices;
    gpu = devices == nullptr ? -1 : devices->GpuOf(sender_gpu);
    if (gpu < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", options_.node, " has no GPU ",
          sender_gpu.empty() ? "at all" : sender_gpu,
          " to send GPU memory to node ", node, " over NCCL"));
    }
    absl::StatusOr<std::string> id = factory_.OfferFabric();
    if (!id.ok()) return id.status();
    fabric_id = *std::move(id);
    auto* setup = req.mutable_nccl();
    setup->set_unique_id(fabric_id);
    setup->set_world_size(2);
    auto* callee = setup->add_ranks();
    callee->set_rank(1);
    callee->set_cuda_uuid(route.nccl().receiver_cuda_uuid());
  } else if (kind == "ucx") {
    req.mutable_ucx()->set_transports(options_.ucx_transports);
    req.mutable_ucx()->set_rail(rail);
  } else {
    req.mutable_tcp()->set_connection_count(1);
    req.mutable_tcp()->set_rail(rail);
  }
  auto stub = v1::Peer::NewStub(peers_->For(address));
  v1::OpenChannelResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(
      std::min(deadline, absl::Now() + absl::Seconds(10))));
  absl::Status s = FromGrpcStatus(stub->OpenChannel(&ctx, req, &resp),
                                  absl::StrCat("OpenChannel to ", node));
  if (!s.ok()) return s;
  *peer_rails = resp.rails();
  if (kind == "nccl") {
    // The receiver is joining as rank 1 on a thread of its own.
    return factory_.JoinFabric(
        gpu, fabric_id, /*rank=*/0, epoch,
        std::min(deadline, absl::Now() + kFabricJoinTimeout));
  }
  std::string host;
  ChannelOffer offer;
  if (!SplitHostPort(resp.tcp().address(), &host, &offer.port)) {
    return absl::InternalError(absl::StrCat(
        "OpenChannel to ", node, ": bad address ", resp.tcp().address()));
  }
  offer.worker_address = resp.ucx_worker_address();
  const bool railed = rail < static_cast<int>(options_.rails.size());
  const std::string local = railed ? options_.rails[rail] : std::string();
  const std::string device =
      railed && rail < static_cast<int>(options_.rail_devices.size())
          ? options_.rail_devices[rail]
          : std::string();
  return factory_.Connect(kind, host, offer, resp.tcp().connection_token(),
                          deadline, local, device);
}

}  // namespace ferry
