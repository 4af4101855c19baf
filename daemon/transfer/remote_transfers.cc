#include "daemon/transfer/remote_transfers.h"

#include <algorithm>
#include <atomic>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "core/checked_math.h"
#include "core/piece.h"
#include "core/region_copy.h"
#include "daemon/memory/memory_map.h"
#include "daemon/transfer/transfer_routes.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/ucx/ucx_channel.h"

namespace ferry {
namespace {

// Outgoing channels and channel ids of NCCL routes: "<node>#nccl".
constexpr char kNcclSuffix[] = "#nccl";
// Routes of one instance in flight at once (threads of Execute); most of
// their time they wait on a peer or the network.
constexpr size_t kMaxRoutesAtOnce = 16;

}  // namespace

bool UcxCovers(const std::string& ucx_nodes, const std::string& node) {
  if (ucx_nodes == "*") return true;
  for (absl::string_view name : absl::StrSplit(ucx_nodes, ',')) {
    if (name == node) return true;
  }
  return false;
}

namespace {

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

}  // namespace

RemoteTransfers::RemoteTransfers(Options options)
    : options_(std::move(options)),
      peers_(options_.credentials),
      router_(options_.engine, options_.devices) {}

RemoteTransfers::~RemoteTransfers() {
  // NCCL joins still running end by their own deadline.
  std::vector<std::shared_ptr<FabricJoin>> joins;
  {
    absl::MutexLock lock(&mu_);
    joins.swap(joins_);
  }
  for (auto& j : joins) {
    if (j->thread.joinable()) j->thread.join();
  }
}

void RemoteTransfers::AddLocal(const std::string& participant_id,
                               std::shared_ptr<const MemoryMap> memory) {
  absl::MutexLock lock(&mu_);
  local_[participant_id] = std::move(memory);
}

void RemoteTransfers::RemoveLocal(const std::string& participant_id) {
  absl::MutexLock lock(&mu_);
  local_.erase(participant_id);
  staging_.erase(participant_id);
}

std::shared_ptr<const MemoryMap> RemoteTransfers::LocalMemory(
    const std::string& participant_id) {
  absl::MutexLock lock(&mu_);
  auto it = local_.find(participant_id);
  return it == local_.end() ? nullptr : it->second;
}

int64_t RemoteTransfers::StagingBytesInUse() {
  absl::MutexLock lock(&mu_);
  int64_t held = 0;
  for (const auto& [id, area] : staging_) {
    if (area != nullptr) held += area->reserved_bytes();
  }
  return held;
}

void RemoteTransfers::ForgetNode(const std::string& node) {
  std::vector<std::unique_ptr<Channel>> doomed;
  absl::MutexLock lock(&mu_);
  for (const std::string& key : {node, node + kNcclSuffix}) {
    auto it = outgoing_.find(key);
    if (it == outgoing_.end()) continue;
    doomed.push_back(std::move(it->second.channel));
    ++it->second.epoch;  // a transfer in flight does not put its channel back
  }
}

bool RemoteTransfers::Handles(const TransferJob& job) const {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  for (const auto& r : pi.ranks) {
    if (r != nullptr && r->node != options_.node) return true;
  }
  if (job.relay) {
    // Ranks all here, the replica it relays from (some) on a member.
    const PlannedInstance& from = sp.instances[sp.InstanceAtPlanIndex(
        sp.plan.instances[pi.plan_index].relay_from)];
    for (const auto& r : from.ranks) {
      if (r != nullptr && r->node != options_.node) return true;
    }
    return false;
  }
  if (job.from_partner) {
    // Ranks all here, the partner it exchanges with (some) on a member.
    const Exchange* exchange = sp.ExchangeOf(pi.plan_index);
    if (exchange == nullptr) return false;
    const PlannedInstance& partner =
        sp.instances[sp.InstanceAtPlanIndex(exchange->partner)];
    for (const auto& r : partner.ranks) {
      if (r != nullptr && r->node != options_.node) return true;
    }
    return false;
  }
  // Ranks all here, sources (some) on a member: that member sends.
  for (const Copy& c : sp.DirectPlan(pi.plan_index).copies) {
    const auto& src = sp.sources[c.src_rank];
    if (src != nullptr && src->node != options_.node) return true;
  }
  return false;
}

std::string RemoteTransfers::ChannelTransport(
    const std::string& node, const v1::NcclRoute* nccl) const {
  if (nccl != nullptr) return "nccl";
  return UcxCovers(options_.ucx_nodes, node) ? "ucx" : "tcp";
}

absl::StatusOr<std::unique_ptr<Channel>> RemoteTransfers::Connect(
    const std::string& node, const std::string& address,
    const std::string& channel_id, int64_t epoch, const v1::NcclRoute* nccl,
    absl::Time deadline) {
  auto stub = v1::Peer::NewStub(
      peers_.For(address));
  v1::OpenChannelRequest req;
  req.set_caller_node(options_.node);
  req.set_channel_id(channel_id);
  req.set_epoch(epoch);
  std::string fabric_id;
  int gpu = -1;
  if (nccl != nullptr) {
    DeviceMemory* devices = options_.devices;
    gpu = devices == nullptr ? -1 : devices->GpuOf(nccl->sender_cuda_uuid());
    if (gpu < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "node ", options_.node, " has no GPU ",
          nccl->sender_cuda_uuid().empty() ? "at all"
                                           : nccl->sender_cuda_uuid(),
          " to send GPU memory to node ", node, " over NCCL"));
    }
    absl::StatusOr<std::string> id = devices->NewFabricId();
    if (!id.ok()) return id.status();
    fabric_id = *std::move(id);
    v1::NcclChannelSetup* setup = req.mutable_nccl();
    setup->set_unique_id(fabric_id);
    setup->set_world_size(2);
    v1::NcclRankAssignment* callee = setup->add_ranks();
    callee->set_rank(1);
    callee->set_cuda_uuid(nccl->receiver_cuda_uuid());
  } else if (UcxCovers(options_.ucx_nodes, node)) {
    req.mutable_ucx()->set_transports(options_.ucx_transports);
  } else {
    req.mutable_tcp()->set_connection_count(1);
  }
  v1::OpenChannelResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(10))));
  absl::Status s = FromGrpcStatus(stub->OpenChannel(&ctx, req, &resp),
                            absl::StrCat("OpenChannel to ", node));
  if (!s.ok()) return s;
  if (nccl != nullptr) {
    // The receiver is joining as rank 1 on a thread of its own.
    return options_.devices->JoinFabric(
        gpu, fabric_id, /*rank=*/0, epoch,
        std::min(deadline, absl::Now() + kFabricJoinTimeout));
  }
  std::string host;
  int port = 0;
  if (!SplitHostPort(resp.tcp().address(), &host, &port)) {
    return absl::InternalError(absl::StrCat(
        "OpenChannel to ", node, ": bad address ", resp.tcp().address()));
  }
  if (req.has_ucx()) {
    UcxChannelOptions options;
    options.transports = options_.ucx_transports;
    options.connection_token = resp.tcp().connection_token();
    return ConnectUcxChannel(host, port, resp.ucx_worker_address(), deadline,
                             options);
  }
  TcpChannelOptions options;
  options.connection_token = resp.tcp().connection_token();
  return ConnectTcpChannel(host, port, deadline, options);
}

absl::Status RemoteTransfers::PinForFabric(Places& places) const {
  for (std::vector<BufferPlace>& bucket : places) {
    for (BufferPlace& place : bucket) {
      if (place.on_gpu() || place.pinned) continue;
      if (place.map == nullptr) {
        return absl::UnimplementedError(
            "a host rank's fallback staging cannot receive GPU memory from "
            "another node (it is not pinned for the GPUs)");
      }
      absl::Status s = place.map->PinForGpus(place.index, options_.devices);
      if (!s.ok()) {
        return absl::UnimplementedError(absl::StrCat(
            "host memory of an NCCL route cannot be pinned for the GPUs: ",
            s.message()));
      }
      place.pinned = true;
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteTransfers::Execute(const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  TransferProgress& progress = *job.progress;
  // The routes (transfer_routes.h), refused before any byte moves when
  // one cannot be carried.
  absl::StatusOr<NodeRoutes> built =
      BuildRoutes(job, options_.node, options_.timeout, [this] {
        absl::MutexLock lock(&mu_);
        return next_bucket_++;
      });
  if (!built.ok()) return built.status();
  std::map<RouteKey, NodeRoute>& routes = built->by_key;
  const std::vector<RouteKey>& order = built->order;
  // Peer addresses of the nodes involved.
  std::map<std::string, std::string> addresses;
  auto address_of = [&](const std::string& n) -> absl::StatusOr<std::string> {
    auto it = addresses.find(n);
    if (it != addresses.end()) return it->second;
    const std::string a = options_.address_of ? options_.address_of(n) : "";
    if (a.empty()) {
      return absl::UnavailableError(
          absl::StrCat("node ", n, " is not a live member"));
    }
    addresses[n] = a;
    return a;
  };
  const absl::Time deadline = absl::Now() + options_.timeout;
  progress.bytes_total.store(LocalExecutor::JobBytes(job));

  // Ranks on this node that a member's route lands in: received here (the
  // member's "send" calls back this node's RunTransfer) until Execute ends.
  std::vector<std::string> receiving;
  for (const RouteKey& key : order) {
    if (key.first == options_.node || key.second != options_.node) continue;
    absl::MutexLock lock(&mu_);
    for (size_t r = 0; r < pi.ranks.size(); ++r) {
      if (pi.ranks[r]->node != options_.node || r >= job.destination.size()) {
        continue;
      }
      receiving_[pi.ranks[r]->id] = job.destination[r];
      receiving.push_back(pi.ranks[r]->id);
    }
    break;
  }
  struct Unregister {
    RemoteTransfers* self;
    const std::vector<std::string>& ids;
    ~Unregister() {
      absl::MutexLock lock(&self->mu_);
      for (const std::string& id : ids) self->receiving_.erase(id);
    }
  } unregister{this, receiving};

  // The routes at once, each on a thread of its own (a route is one
  // channel between two nodes, so they do not contend for a channel; the
  // wait is on the network and the peers): this node sends, or asks the
  // sources' node to. The addresses first, so a node that is gone fails
  // the job before any byte moves.
  for (const RouteKey& key : order) {
    if (key.first == options_.node && key.second == options_.node) continue;
    // The receiving node's (this one's too: a member sends to it), and the
    // sending node's where another node sends.
    if (absl::StatusOr<std::string> a = address_of(key.second); !a.ok()) {
      return a.status();
    }
    if (key.first == options_.node) continue;
    if (absl::StatusOr<std::string> a = address_of(key.first); !a.ok()) {
      return a.status();
    }
  }
  std::map<std::string, v1::ParticipantStaging> staging;
  absl::Mutex results_mu;
  absl::Status first_error;
  std::atomic<bool> failed{false};
  // Another route failed: the job fails anyway, so the rest stop early.
  auto give_up = [&] { return failed.load() || progress.cancel.load(); };
  auto run_route = [&](const RouteKey& key) -> absl::Status {
    const std::string& src_node = key.first;
    const std::string& node = key.second;
    NodeRoute& route = routes.at(key);  // each route's own, on one thread
    v1::RunTransferResponse resp;
    absl::Status s;
    if (src_node == options_.node && node == options_.node) {
      absl::StatusOr<int64_t> copied = CopyHere(
          route.views, route.view_places, route.local, route.local_places,
          give_up, [&](int64_t b) { progress.bytes_moved.fetch_add(b); });
      // APPLY: the coordinator's own staging, below.
      return copied.status();
    }
    const std::string address = addresses.at(node);
    if (src_node == options_.node) {
      if (route.req.has_nccl()) {
        s = PinForFabric(route.view_places);
        if (!s.ok()) return s;
      }
      s = SendRoute(
          node, address, route.req, route.views, deadline, give_up,
          [&](int64_t b) { progress.bytes_moved.fetch_add(b); }, &resp);
    } else {
      const std::string sender = addresses.at(src_node);
      if (src_node == node) {
        route.req.set_role("local");
      } else {
        route.req.set_role("send");
        route.req.set_peer_node(node);
        route.req.set_peer_address(address);
      }
      s = CallRunTransfer(src_node, sender, route.req, deadline, give_up,
                          &resp);
      if (s.ok()) progress.bytes_moved.fetch_add(route.bytes);
    }
    if (!s.ok()) return s;
    absl::MutexLock lock(&results_mu);
    for (const v1::ParticipantStaging& ps : resp.staging()) {
      staging[ps.participant_id()] = ps;
    }
    return absl::OkStatus();
  };
  std::atomic<size_t> next_route{0};
  auto worker = [&] {
    for (size_t i = next_route++; i < order.size(); i = next_route++) {
      absl::Status s = run_route(order[i]);
      if (s.ok()) continue;
      absl::MutexLock lock(&results_mu);
      // The first failure is the cause; routes that stopped because of it
      // say "cancelled".
      if (first_error.ok() || (absl::IsCancelled(first_error) &&
                               !absl::IsCancelled(s))) {
        first_error = s;
      }
      failed.store(true);
    }
  };
  {
    std::vector<std::thread> threads;
    const size_t n = std::min(order.size(), kMaxRoutesAtOnce);
    for (size_t i = 1; i < n; ++i) threads.emplace_back(worker);
    worker();
    for (std::thread& t : threads) t.join();
  }
  if (!first_error.ok()) return first_error;

  // Ranks on this node: the coordinator's own staging.
  for (size_t r = 0; r < pi.ranks.size(); ++r) {
    if (pi.ranks[r]->node != options_.node) continue;
    if (r >= job.destination.size() || job.destination[r].staging == nullptr) {
      continue;
    }
    const StagingArea& area = *job.destination[r].staging;
    v1::ParticipantStaging& ps = staging[pi.ranks[r]->id];
    ps.set_participant_id(pi.ranks[r]->id);
    for (v1::MemoryRegion& region : area.Exported()) {
      *ps.add_regions() = std::move(region);
    }
    if (pi.resolved == nullptr) continue;
    for (const FallbackTensor& f : pi.resolved->ranks[r].fallback) {
      const std::string& name = sp.model.params[f.param].name;
      const StagingArea::Slot* slot = area.Find(name);
      if (slot == nullptr) continue;
      v1::StagingSlot* ss = ps.add_slots();
      ss->set_parameter(name);
      ss->set_region_id(slot->region_id);
      ss->set_bytes(slot->bytes);
    }
  }

  // APPLY names the staging on the ranks' node.
  if (job.apply != nullptr) *job.apply = ApplyDetailsOf(job, staging);
  return absl::OkStatus();
}
absl::StatusOr<int64_t> RemoteTransfers::CopyHere(
    const std::vector<BucketView>& from, Places& from_places,
    const std::vector<BucketView>& to, Places& to_places,
    const std::function<bool()>& cancelled,
    const std::function<void(int64_t)>& on_bytes) {
  if (from.size() != to.size() || from_places.size() != from.size() ||
      to_places.size() != to.size()) {
    return absl::InvalidArgumentError(
        "copy on one node: the two sides have different bucket counts");
  }
  // Route every box first, so a box no engine can do fails before any
  // byte moves.
  std::vector<std::vector<CopyEngine*>> engines(from.size());
  for (size_t i = 0; i < from.size(); ++i) {
    if (from[i].regions.size() != to[i].regions.size() ||
        from_places[i].size() != from[i].regions.size() ||
        to_places[i].size() != to[i].regions.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "copy on one node: bucket ", from[i].id,
          " has different box counts on its two sides"));
    }
    for (size_t j = 0; j < from[i].regions.size(); ++j) {
      absl::StatusOr<CopyEngine*> engine =
          router_.EngineFor(from_places[i][j], to_places[i][j]);
      if (!engine.ok()) {
        return absl::Status(
            engine.status().code(),
            absl::StrCat("bucket ", from[i].id, " box ", j, ": from ",
                         KindOf(from_places[i][j]), " to ",
                         KindOf(to_places[i][j]), ", and ",
                         engine.status().message()));
      }
      engines[i].push_back(*engine);
    }
  }
  int64_t copied = 0;
  CopyRouter::Batch batch;
  for (size_t i = 0; i < from.size(); ++i) {
    if (cancelled()) return absl::CancelledError("cancelled");
    batch.Clear();
    for (size_t j = 0; j < from[i].regions.size(); ++j) {
      LocalCopy c;
      c.src = from[i].regions[j];
      c.dst = to[i].regions[j];
      c.extent = to[i].extents[j];
      c.unit_bytes = to[i].unit_bytes[j];
      batch.Add(engines[i][j], std::move(c));
    }
    absl::Status s = router_.Run(batch);
    if (!s.ok()) return s;
    copied += to[i].bytes;
    on_bytes(to[i].bytes);
  }
  return copied;
}

absl::Status RemoteTransfers::CallRunTransfer(
    const std::string& node, const std::string& address,
    const v1::RunTransferRequest& req, absl::Time deadline,
    const std::function<bool()>& cancelled, v1::RunTransferResponse* resp) {
  auto stub = v1::Peer::NewStub(
      peers_.For(address));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  grpc::Status rpc_status;
  absl::Notification done;
  std::thread call([&] {
    rpc_status = stub->RunTransfer(&ctx, req, resp);
    done.Notify();
  });
  bool cancel_sent = false;
  while (!done.WaitForNotificationWithTimeout(absl::Milliseconds(20))) {
    if (!cancel_sent && cancelled()) {
      ctx.TryCancel();
      cancel_sent = true;
    }
  }
  call.join();
  return FromGrpcStatus(rpc_status, absl::StrCat("node ", node, " RunTransfer"));
}

absl::Status RemoteTransfers::SendRoute(
    const std::string& node, const std::string& address,
    v1::RunTransferRequest req, const std::vector<BucketView>& views,
    absl::Time deadline, const std::function<bool()>& cancelled,
    const std::function<void(int64_t)>& on_bytes,
    v1::RunTransferResponse* resp) {
  // The channel to the node (NCCL routes have their own): kept, or opened
  // with the next epoch.
  const v1::NcclRoute* nccl = req.has_nccl() ? &req.nccl() : nullptr;
  const std::string key = nccl != nullptr ? node + kNcclSuffix : node;
  const std::string channel_id = absl::StrCat(options_.node, "->", key);
  req.set_caller_node(options_.node);
  req.set_role("");
  req.clear_send();
  req.clear_peer_node();
  req.clear_peer_address();
  req.set_channel_id(channel_id);

  // Transfers of several instances run at once (the coordinator's
  // transfer workers, a member's RunTransfer calls): one route at a time
  // per channel.
  {
    absl::MutexLock lock(&mu_);
    auto free = [this, &key]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !outgoing_[key].in_use;
    };
    while (!mu_.AwaitWithTimeout(absl::Condition(&free),
                                 absl::Milliseconds(50))) {
      if (cancelled()) return absl::CancelledError("cancelled");
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            "channel ", channel_id, " stayed busy with other routes until "
            "the transfer's deadline"));
      }
    }
    outgoing_[key].in_use = true;
  }
  struct Release {
    RemoteTransfers* self;
    const std::string& key;
    ~Release() {
      absl::MutexLock lock(&self->mu_);
      self->outgoing_[key].in_use = false;
    }
  } release{this, key};

  // A kept channel may be stale (the receiver's daemon restarted, and only
  // the coordinator hears of membership changes): when a transfer on one
  // fails, the route is sent again once on a new channel. Resending is
  // safe: every byte of the route is written again.
  for (int attempt = 0;; ++attempt) {
    std::unique_ptr<Channel> channel;
    int64_t epoch = 0;
    bool first_open = false;
    {
      absl::MutexLock lock(&mu_);
      Outgoing& out = outgoing_[key];
      channel = std::move(out.channel);
      // Epochs start at the wall clock, so a restarted sender opens a
      // higher epoch than the one a surviving receiver still holds.
      first_open = out.epoch == 0;
      if (out.epoch == 0) out.epoch = absl::ToUnixMicros(absl::Now());
      if (channel == nullptr) ++out.epoch;
      epoch = out.epoch;
    }
    const bool kept = channel != nullptr;
    if (channel == nullptr) {
      absl::StatusOr<std::unique_ptr<Channel>> c =
          Connect(node, address, channel_id, epoch, nccl, deadline);
      if (!c.ok()) return c.status();
      channel = *std::move(c);
      LOG(INFO) << "opened a " << ChannelTransport(node, nccl)
                << " channel to node " << node << " (epoch " << epoch << ")";
      if (options_.metrics != nullptr) {
        options_.metrics->ChannelOpened(ChannelTransport(node, nccl),
                                        first_open);
      }
    }
    req.set_channel_epoch(epoch);

    // The receiver's RunTransfer runs while this thread sends.
    auto stub = v1::Peer::NewStub(
        peers_.For(address));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(deadline));
    grpc::Status rpc_status;
    std::thread receiver(
        [&] { rpc_status = stub->RunTransfer(&ctx, req, resp); });

    absl::Status sent = absl::OkStatus();
    int64_t sent_bytes = 0;
    for (const BucketView& view : views) {
      if (cancelled()) {
        sent = absl::CancelledError("cancelled");
        break;
      }
      sent = NameMemoryFault(channel->Send(view, deadline));
      if (!sent.ok()) break;
      on_bytes(view.bytes);
      sent_bytes += view.bytes;
    }
    if (sent.ok()) sent = channel->Flush(deadline);
    if (!sent.ok()) {
      channel.reset();  // the receiver sees the connection close
      ctx.TryCancel();
    }
    receiver.join();
    absl::Status received =
        FromGrpcStatus(rpc_status, absl::StrCat("node ", node, " RunTransfer"));
    if (sent.ok() && received.ok()) {
      absl::MutexLock lock(&mu_);
      Outgoing& out = outgoing_[key];
      if (out.epoch == epoch) out.channel = std::move(channel);
      return absl::OkStatus();
    }
    // Broken for good: the next attempt or transfer opens a higher epoch.
    const absl::Status failed = !sent.ok() ? sent : received;
    if (!kept || attempt > 0 || cancelled() || absl::Now() >= deadline) {
      return failed;
    }
    LOG(INFO) << "channel " << channel_id << " epoch " << epoch
              << " failed (" << failed << "); sending again on a new one";
    on_bytes(-sent_bytes);
    *resp = v1::RunTransferResponse();
  }
}

}  // namespace ferry
