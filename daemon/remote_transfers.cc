#include "daemon/remote_transfers.h"

#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "core/checked_math.h"
#include "core/piece.h"
#include "core/region_copy.h"
#include "daemon/memory_map.h"
#include "proto/grpc_status.h"
#include "proto/convert.h"
#include "transport/tcp/tcp_channel.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"

namespace ferry {
namespace {

// Outgoing channels and channel ids of NCCL routes: "<node>#nccl".
constexpr char kNcclSuffix[] = "#nccl";
// How long the two daemons of an NCCL channel have to join it.
constexpr absl::Duration kFabricJoinTimeout = absl::Seconds(60);

// Channels one peer may hold into this daemon (one per route and
// transport; a cluster has a handful), and the length of their names.
constexpr int kMaxChannelsPerPeer = 16;
constexpr size_t kMaxChannelIdBytes = 512;

std::string NewConnectionToken() {
  std::random_device rd;
  return absl::StrFormat("ferry-chan-%08x%08x%08x%08x", rd(), rd(), rd(),
                         rd());
}

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
  // Ranks all here, sources (some) on a member: that member sends.
  for (const Copy& c : sp.direct_plan().instances[pi.plan_index].copies) {
    const auto& src = sp.sources[c.src_rank];
    if (src != nullptr && src->node != options_.node) return true;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<Channel>> RemoteTransfers::Connect(
    const std::string& node, const std::string& address,
    const std::string& channel_id, int64_t epoch, const v1::NcclRoute* nccl,
    absl::Time deadline) {
  auto stub = v1::Peer::NewStub(
      grpc::CreateChannel(address, options_.credentials));
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

namespace {

int64_t BoxBytesOf(const Dims& extent, int64_t unit_bytes) {
  int64_t n = unit_bytes;
  for (int64_t e : extent) n *= e;
  return n;
}

void AddBox(v1::TransferBucket* wire, const std::string& participant_id,
            uint32_t buffer, int64_t byte_offset,
            const Dims& strides, const Dims& extent,
            int64_t unit_bytes) {
  v1::TransferBox* b = wire->add_boxes();
  b->set_participant_id(participant_id);
  b->set_buffer(buffer);
  b->set_byte_offset(byte_offset);
  for (int64_t st : strides) b->add_strides(st);
  for (int64_t e : extent) b->add_extent(e);
  b->set_unit_bytes(unit_bytes);
  wire->set_bytes(wire->bytes() + BoxBytesOf(extent, unit_bytes));
}

}  // namespace

std::vector<std::vector<RemoteTransfers::Move>> RemoteTransfers::MovesOf(
    const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  const std::vector<RankLayout>& layout = *pi.layout;
  std::vector<std::vector<Move>> buckets;
  if (!job.relay) {
    const InstancePlan& ip = sp.direct_plan().instances[pi.plan_index];
    for (const Bucket& bucket : ip.buckets) {
      buckets.emplace_back();
      for (int32_t k = bucket.first_copy;
           k < bucket.first_copy + bucket.num_copies; ++k) {
        const Copy& c = ip.copies[k];
        buckets.back().push_back(
            Move{sp.sources[c.src_rank].get(),
                 &sp.source_layouts[c.src_rank].pieces[c.src_piece],
                 c.dst_rank, &layout[c.dst_rank].pieces[c.dst_piece],
                 ip.BoxOf(c, layout), c.param});
      }
    }
    return buckets;
  }
  // Relay: rank r's piece i from rank r's piece i of the replica (the same
  // layout), in buckets of the plan's size.
  const PlannedInstance& from = sp.instances[sp.InstanceAtPlanIndex(
      sp.plan.instances[pi.plan_index].relay_from)];
  int64_t bytes = 0;
  for (size_t r = 0; r < layout.size(); ++r) {
    for (size_t i = 0; i < layout[r].pieces.size(); ++i) {
      const Piece& piece = layout[r].pieces[i];
      const int64_t b = BoxBytes(piece.box, sp.model.params[piece.param].dtype);
      if (buckets.empty() ||
          (sp.plan.bucket_bytes > 0 && bytes + b > sp.plan.bucket_bytes &&
           !buckets.back().empty())) {
        buckets.emplace_back();
        bytes = 0;
      }
      buckets.back().push_back(Move{from.ranks[r].get(),
                                    &(*from.layout)[r].pieces[i],
                                    static_cast<int32_t>(r), &piece, piece.box,
                                    piece.param});
      bytes += b;
    }
  }
  return buckets;
}

absl::Status RemoteTransfers::Execute(const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  TransferProgress& progress = *job.progress;
  const std::vector<std::vector<Move>> buckets = MovesOf(job);
  // Routes between nodes with a box of GPU memory travel over NCCL, on
  // the GPU of the first GPU rank on each side (else the node's first).
  using RouteKey = std::pair<std::string, std::string>;
  std::map<RouteKey, v1::NcclRoute> nccl_routes;
  for (const std::vector<Move>& bucket : buckets) {
   for (const Move& m : bucket) {
    const Participant& src = *m.source;
    const Participant& dst = *pi.ranks[m.dst_rank];
    if (src.node == dst.node) continue;
    const bool src_gpu = !(m.src->buffer & kStagingBufferBit) &&
                         src.memory != nullptr &&
                         m.src->buffer < src.memory->size() &&
                         src.memory->on_device(m.src->buffer);
    const bool dst_gpu = !(m.dst->buffer & kStagingBufferBit) &&
                         dst.memory != nullptr &&
                         m.dst->buffer < dst.memory->size() &&
                         dst.memory->on_device(m.dst->buffer);
    if (!src_gpu && !dst_gpu) continue;
    v1::NcclRoute& route = nccl_routes[RouteKey(src.node, dst.node)];
    if (src_gpu && route.sender_cuda_uuid().empty()) {
      route.set_sender_cuda_uuid(src.device.cuda_uuid());
    }
    if (dst_gpu && route.receiver_cuda_uuid().empty()) {
      route.set_receiver_cuda_uuid(dst.device.cuda_uuid());
    }
   }
  }
  for (const std::vector<Move>& bucket : buckets) {
   for (const Move& m : bucket) {
    const Participant& src = *m.source;
    const Participant& dst = *pi.ranks[m.dst_rank];
    // The receiving GPU unpacks into staging too, which only GPU ranks have
    // pinned: refused here, before any byte moves.
    if (src.node != dst.node && (m.dst->buffer & kStagingBufferBit) &&
        nccl_routes.count(RouteKey(src.node, dst.node)) > 0 &&
        (dst.memory == nullptr || !dst.memory->any_on_device())) {
      return absl::UnimplementedError(absl::StrCat(
          sp.model.params[m.param].name, ": ", dst.Describe(), " (node ",
          dst.node, ") registered host memory, and its fallback staging "
          "cannot receive GPU memory from node ", src.node, " (it is not "
          "pinned for the GPUs)"));
    }
    // Relays read the replica's live buffers; its staging stays on its
    // node (LocalExecutor relays staging on one node).
    if (job.relay && (m.src->buffer & kStagingBufferBit)) {
      return absl::InternalError(absl::StrCat(
          pi.id, ": a relay between nodes cannot read ", src.Describe(),
          "'s staging"));
    }
    if (src.node == options_.node &&
        (src.memory == nullptr || !src.memory->mapped())) {
      return absl::InternalError(
          absl::StrCat(src.Describe(), ": its memory is not mapped"));
    }
    if (dst.node == options_.node &&
        (static_cast<size_t>(m.dst_rank) >= job.destination.size() ||
         job.destination[m.dst_rank].client == nullptr)) {
      return absl::InternalError(
          absl::StrCat(dst.Describe(), ": its memory is not mapped"));
    }
   }
  }
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

  // One route per (source node, destination node), each bucket split by
  // route (plan order).
  struct Route {
    v1::RunTransferRequest req;     // the receiver's part (+ "send" part)
    std::vector<BucketView> views;  // sources on this node
    std::vector<BucketView> local;  // this node -> this node: destinations
    Places view_places, local_places;  // where each box of those is
    int64_t bytes = 0;
  };
  std::map<RouteKey, Route> routes;
  std::vector<RouteKey> order;
  auto route_of = [&](const RouteKey& key) -> Route& {
    auto it = routes.find(key);
    if (it != routes.end()) return it->second;
    order.push_back(key);
    Route& route = routes[key];
    v1::RunTransferRequest& req = route.req;
    req.set_caller_node(options_.node);
    req.set_stream(sp.stream);
    req.set_instance_id(pi.id);
    req.set_timeout_ms(absl::ToInt64Milliseconds(options_.timeout));
    auto nccl = nccl_routes.find(key);
    if (nccl != nccl_routes.end()) *req.mutable_nccl() = nccl->second;
    // Staging for fallback tensors, reserved on the destination's node
    // (this node: the coordinator's own, already reserved).
    if (pi.resolved != nullptr && key.second != options_.node) {
      for (size_t r = 0; r < pi.ranks.size(); ++r) {
        if (pi.ranks[r]->node != key.second) continue;
        const auto& fallback = pi.resolved->ranks[r].fallback;
        for (size_t k = 0; k < fallback.size(); ++k) {
          const ParamSpec& spec = sp.model.params[fallback[k].param];
          v1::StagingNeed* need = req.add_staging();
          need->set_participant_id(pi.ranks[r]->id);
          need->set_slot(static_cast<int32_t>(k));
          need->set_parameter(spec.name);
          need->set_bytes(BoxBytes(FullBox(spec.shape), spec.dtype));
        }
      }
    }
    return route;
  };
  for (const std::vector<Move>& bucket : buckets) {
    std::map<RouteKey, int> part;  // route -> index in its buckets
    for (const Move& m : bucket) {
      const Participant& source = *m.source;
      const bool here = source.node == options_.node;
      const RouteKey key(source.node, pi.ranks[m.dst_rank]->node);
      const bool local_here = here && key.second == options_.node;
      Route& route = route_of(key);
      auto [at, added] = part.try_emplace(key, route.req.receive_size());
      if (added) {
        uint64_t id = 0;
        {
          absl::MutexLock lock(&mu_);
          id = next_bucket_++;
        }
        route.req.add_receive()->set_id(id);
        if (here) {
          route.views.emplace_back();
          route.views.back().id = id;
          route.view_places.emplace_back();
          if (local_here) {
            route.local.emplace_back();
            route.local.back().id = id;
            route.local_places.emplace_back();
          }
        } else {
          route.req.add_send()->set_id(id);
        }
      }
      const Piece& src = *m.src;
      const Piece& dst = *m.dst;
      const DType dtype = sp.model.params[m.param].dtype;
      const Box& box = m.box;
      const Dims extent = StorageBox(box, dtype).extent;
      const int64_t unit = UnitBytes(dtype);
      const int64_t bytes = BoxBytesOf(extent, unit);
      route.bytes += bytes;
      AddBox(route.req.mutable_receive(at->second), pi.ranks[m.dst_rank]->id,
             dst.buffer, ByteOffsetOf(dst, box, dtype), dst.strides, extent,
             unit);
      if (here) {
        const MemoryMap& src_memory = *source.memory;
        if (src.buffer >= src_memory.size()) {
          return absl::InternalError(absl::StrCat(
              source.Describe(), ": buffer ", src.buffer, " is not mapped"));
        }
        BucketView& view = route.views[at->second];
        RegionView region;
        region.base =
            src_memory.base(src.buffer) + ByteOffsetOf(src, box, dtype);
        region.strides = src.strides;
        view.regions.push_back(region);
        view.extents.push_back(extent);
        view.unit_bytes.push_back(unit);
        view.bytes += bytes;
        route.view_places[at->second].push_back(PlaceIn(src_memory, src.buffer));
        if (local_here) {
          const BufferPlace dst_place =
              job.destination[m.dst_rank].Find(dst.buffer);
          uint8_t* dst_base = dst_place.base;
          if (dst_base == nullptr) {
            return absl::InternalError(
                absl::StrCat(pi.ranks[m.dst_rank]->Describe(), ": buffer ",
                             dst.buffer, " is not mapped"));
          }
          BucketView& to = route.local[at->second];
          RegionView d;
          d.base = dst_base + ByteOffsetOf(dst, box, dtype);
          d.strides = dst.strides;
          to.regions.push_back(d);
          to.extents.push_back(extent);
          to.unit_bytes.push_back(unit);
          to.bytes += bytes;
          route.local_places[at->second].push_back(dst_place);
        }
      } else {
        AddBox(route.req.mutable_send(at->second), source.id, src.buffer,
               ByteOffsetOf(src, box, dtype), src.strides, extent, unit);
      }
    }
  }

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

  // Route by route: this node sends, or asks the sources' node to.
  std::map<std::string, v1::ParticipantStaging> staging;
  for (const RouteKey& key : order) {
    const std::string& src_node = key.first;
    const std::string& node = key.second;
    Route& route = routes[key];
    v1::RunTransferResponse resp;
    absl::Status s;
    if (src_node == options_.node && node == options_.node) {
      absl::StatusOr<int64_t> copied = CopyHere(
          route.views, route.view_places, route.local, route.local_places,
          [&] { return progress.cancel.load(); },
          [&](int64_t b) { progress.bytes_moved.fetch_add(b); });
      if (!copied.ok()) return copied.status();
      continue;  // APPLY: the coordinator's own staging, below
    }
    absl::StatusOr<std::string> address = address_of(node);
    if (!address.ok()) return address.status();
    if (src_node == options_.node) {
      if (route.req.has_nccl()) {
        s = PinForFabric(route.view_places);
        if (!s.ok()) return s;
      }
      s = SendRoute(
          node, *address, route.req, route.views, deadline,
          [&] { return progress.cancel.load(); },
          [&](int64_t b) { progress.bytes_moved.fetch_add(b); }, &resp);
    } else {
      absl::StatusOr<std::string> sender = address_of(src_node);
      if (!sender.ok()) return sender.status();
      if (src_node == node) {
        route.req.set_role("local");
      } else {
        route.req.set_role("send");
        route.req.set_peer_node(node);
        route.req.set_peer_address(*address);
      }
      s = CallRunTransfer(src_node, *sender, route.req, deadline,
                          [&] { return progress.cancel.load(); }, &resp);
      if (s.ok()) progress.bytes_moved.fetch_add(route.bytes);
    }
    if (!s.ok()) return s;
    for (const v1::ParticipantStaging& ps : resp.staging()) {
      staging[ps.participant_id()] = ps;
    }
  }

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

  if (job.apply != nullptr) {
    // APPLY names the staging on the ranks' node.
    job.apply->assign(pi.ranks.size(), v1::ApplyDetail());
    for (size_t r = 0; r < pi.ranks.size(); ++r) {
      v1::ApplyDetail& apply = (*job.apply)[r];
      auto found = staging.find(pi.ranks[r]->id);
      if (found == staging.end()) continue;
      const v1::ParticipantStaging& ps = found->second;
      *apply.mutable_staging_regions() = ps.regions();
      if (pi.resolved == nullptr) continue;
      for (const FallbackTensor& f : pi.resolved->ranks[r].fallback) {
        const ParamSpec& spec = sp.model.params[f.param];
        for (const v1::StagingSlot& slot : ps.slots()) {
          if (slot.parameter() != spec.name) continue;
          v1::FallbackTensor* t = apply.add_fallback_tensors();
          t->set_parameter(spec.name);
          t->set_dtype(DTypeToProto(spec.dtype));
          for (int64_t d : spec.shape) t->add_shape(d);
          t->set_region_id(slot.region_id());
          t->set_byte_offset(0);
          t->set_size_bytes(slot.bytes());
        }
      }
    }
  }
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
      grpc::CreateChannel(address, options_.credentials));
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

  // A kept channel may be stale (the receiver's daemon restarted, and only
  // the coordinator hears of membership changes): when a transfer on one
  // fails, the route is sent again once on a new channel. Resending is
  // safe: every byte of the route is written again.
  for (int attempt = 0;; ++attempt) {
    std::unique_ptr<Channel> channel;
    int64_t epoch = 0;
    {
      absl::MutexLock lock(&mu_);
      Outgoing& out = outgoing_[key];
      channel = std::move(out.channel);
      // Epochs start at the wall clock, so a restarted sender opens a
      // higher epoch than the one a surviving receiver still holds.
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
    }
    req.set_channel_epoch(epoch);

    // The receiver's RunTransfer runs while this thread sends.
    auto stub = v1::Peer::NewStub(
        grpc::CreateChannel(address, options_.credentials));
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

absl::Status RemoteTransfers::OpenChannel(
    const v1::OpenChannelRequest& request, v1::OpenChannelResponse* response) {
  if (request.caller_node().empty() || request.channel_id().empty() ||
      request.epoch() <= 0) {
    return absl::InvalidArgumentError(
        "OpenChannel: caller_node, channel_id and epoch > 0 are required");
  }
  if (request.has_nccl()) return OpenFabric(request);
  if (!request.has_tcp()) {
    return absl::InvalidArgumentError(
        "OpenChannel: a transport (tcp or nccl) is required");
  }
  TcpChannelOptions options;
  options.connection_token = NewConnectionToken();
  absl::StatusOr<std::unique_ptr<ChannelListener>> listener =
      ListenTcp(options_.listen_host, 0, options);
  if (!listener.ok()) return listener.status();
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Incoming*> fresh = NewEpochLocked(request);
  if (!fresh.ok()) return fresh.status();
  Incoming& in = **fresh;
  in.token = options.connection_token;
  in.listener = *std::move(listener);
  response->mutable_tcp()->set_address(
      absl::StrCat(options_.host, ":", in.listener->port()));
  response->mutable_tcp()->set_connection_token(in.token);
  return absl::OkStatus();
}

absl::StatusOr<RemoteTransfers::Incoming*> RemoteTransfers::NewEpochLocked(
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
  // The lower epoch's channel goes (an NCCL communicator is aborted).
  in = Incoming();
  in.epoch = request.epoch();
  return &in;
}

absl::Status RemoteTransfers::OpenFabric(const v1::OpenChannelRequest& request) {
  const v1::NcclChannelSetup& setup = request.nccl();
  if (setup.unique_id().empty() || setup.world_size() != 2 ||
      setup.ranks_size() != 1 || setup.ranks(0).rank() != 1) {
    return absl::InvalidArgumentError(
        "OpenChannel nccl: a unique_id, world_size 2 and this daemon as "
        "rank 1 are required (the channels are two-rank communicators)");
  }
  const std::string& uuid = setup.ranks(0).cuda_uuid();
  const int gpu =
      options_.devices == nullptr ? -1 : options_.devices->GpuOf(uuid);
  if (gpu < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenChannel nccl: node ", options_.node, " has no GPU ",
        uuid.empty() ? "at all" : uuid,
        options_.devices == nullptr
            ? std::string()
            : absl::StrCat(" (", options_.devices->Available().message(), ")")));
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
  DeviceMemory* devices = options_.devices;
  const std::string id = setup.unique_id();
  const int64_t epoch = request.epoch();
  FabricJoin* j = join.get();
  join->thread = std::thread([j, devices, gpu, id, epoch] {
    j->channel = devices->JoinFabric(gpu, id, /*rank=*/1, epoch,
                                     absl::Now() + kFabricJoinTimeout);
    j->done.Notify();
  });
  joins_.push_back(std::move(join));
  return absl::OkStatus();
}

absl::Status RemoteTransfers::RunTransfer(
    const v1::RunTransferRequest& request,
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

absl::Status RemoteTransfers::ReserveStagingLocked(
    const v1::RunTransferRequest& request, v1::RunTransferResponse* response,
    StagingBases* staging_bases, KeepAlive* keep) {
  // Staging on this node for the ranks' fallback tensors.
  std::map<std::string, std::vector<std::pair<std::string, int64_t>>> needs;
  std::map<std::string, std::map<int32_t, std::string>> slot_names;
  int64_t wanted = 0;
  for (const v1::StagingNeed& n : request.staging()) {
    needs[n.participant_id()].emplace_back(n.parameter(), n.bytes());
    slot_names[n.participant_id()][n.slot()] = n.parameter();
    if (n.bytes() < 0 || !CheckedAdd(wanted, n.bytes(), &wanted)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RunTransfer: staging need of ", n.parameter(), " is ", n.bytes(),
          " bytes"));
    }
  }
  // This node's limit is on all its staging together: what other ranks
  // hold plus what these need (their own slots are replaced, not added).
  if (options_.max_staging_bytes > 0 && !needs.empty()) {
    int64_t others = 0;
    for (const auto& [id, area] : staging_) {
      if (area != nullptr && needs.count(id) == 0) {
        others += area->reserved_bytes();
      }
    }
    if (wanted > options_.max_staging_bytes - others) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "node ", options_.node, ": its ranks need ", wanted,
          " bytes of staging for their fallback tensors; with the ", others,
          " bytes other ranks there hold, that is over its staging limit of ",
          options_.max_staging_bytes, " bytes (--max_staging_mb)"));
    }
  }
  for (auto& [id, list] : needs) {
    std::shared_ptr<StagingArea>& area = staging_[id];
    if (area == nullptr) {
      // A rank that registered GPU memory gets staging its GPU can write.
      auto m = local_.find(id);
      const bool gpu_rank = m != local_.end() && m->second != nullptr &&
                            m->second->any_on_device();
      area = std::make_shared<StagingArea>(
          id, gpu_rank ? options_.devices : nullptr);
    }
    absl::Status reserved = area->Reserve(list);
    if (!reserved.ok()) return reserved;
    keep->push_back(area);
    v1::ParticipantStaging* out = response->add_staging();
    out->set_participant_id(id);
    for (v1::MemoryRegion& region : area->Exported()) {
      *out->add_regions() = std::move(region);
    }
    for (const auto& [k, name] : slot_names[id]) {
      const StagingArea::Slot* slot = area->Find(name);
      if (slot == nullptr) continue;
      BufferPlace place;
      place.base = slot->memory.data();
      place.pinned = area->pinned();
      (*staging_bases)[id][k] = place;
      v1::StagingSlot* ss = out->add_slots();
      ss->set_parameter(name);
      ss->set_region_id(slot->region_id);
      ss->set_bytes(slot->bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteTransfers::ViewsLocked(
    const google::protobuf::RepeatedPtrField<v1::TransferBucket>& buckets,
    const StagingBases& staging_bases, bool gpu_ok,
    std::vector<BucketView>* views, Places* places, KeepAlive* keep) {
  for (const v1::TransferBucket& wire : buckets) {
    BucketView view;
    view.id = wire.id();
    view.bytes = wire.bytes();
    places->emplace_back();
    for (const v1::TransferBox& b : wire.boxes()) {
      BufferPlace place;
      auto rm = receiving_.find(b.participant_id());
      auto m = local_.find(b.participant_id());
      if (rm != receiving_.end()) {
        // A rank on the coordinator's node: the memory and staging it mapped.
        place = rm->second.Find(b.buffer());
        keep->push_back(rm->second.client);
        keep->push_back(rm->second.staging);
      } else if (m == local_.end() || m->second == nullptr) {
        return absl::NotFoundError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(),
            " did not register through node ", options_.node));
      } else if (b.buffer() & kStagingBufferBit) {
        const int32_t k =
            static_cast<int32_t>(b.buffer() & ~kStagingBufferBit);
        auto bases = staging_bases.find(b.participant_id());
        if (bases != staging_bases.end()) {
          auto slot = bases->second.find(k);
          if (slot != bases->second.end()) place = slot->second;
        }
      } else {
        place = PlaceIn(*m->second, b.buffer());
        keep->push_back(m->second);
      }
      if (place.base == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(),
            " has no buffer ", b.buffer()));
      }
      if (place.on_gpu() && !gpu_ok) {
        return absl::UnimplementedError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(), " buffer ",
            b.buffer(), " is GPU memory, which between nodes needs the NCCL "
            "channel, not wired into ferryd yet"));
      }
      places->back().push_back(place);
      RegionView region;
      region.base = place.base + b.byte_offset();
      region.strides.assign(b.strides().begin(), b.strides().end());
      view.regions.push_back(region);
      view.extents.emplace_back(b.extent().begin(), b.extent().end());
      view.unit_bytes.push_back(b.unit_bytes());
    }
    views->push_back(std::move(view));
  }
  return absl::OkStatus();
}

absl::Status RemoteTransfers::RunSend(const v1::RunTransferRequest& request,
                                      const std::function<bool()>& cancelled,
                                      v1::RunTransferResponse* response) {
  if (request.peer_node().empty() || request.peer_address().empty() ||
      request.send_size() != request.receive_size()) {
    return absl::InvalidArgumentError(
        "RunTransfer send: peer_node, peer_address and one send bucket per "
        "receive bucket are required");
  }
  const absl::Time deadline =
      absl::Now() + (request.timeout_ms() > 0
                         ? absl::Milliseconds(request.timeout_ms())
                         : options_.timeout);
  std::vector<BucketView> views;
  Places places;
  KeepAlive keep;
  {
    absl::MutexLock lock(&mu_);
    absl::Status s = ViewsLocked(request.send(), StagingBases(),
                                 /*gpu_ok=*/request.has_nccl(), &views,
                                 &places, &keep);
    if (!s.ok()) return s;
  }
  if (request.has_nccl()) {
    if (absl::Status s = PinForFabric(places); !s.ok()) return s;
  }
  return SendRoute(request.peer_node(), request.peer_address(), request,
                   views, deadline, cancelled, [](int64_t) {}, response);
}

absl::Status RemoteTransfers::RunLocal(const v1::RunTransferRequest& request,
                                       const std::function<bool()>& cancelled,
                                       v1::RunTransferResponse* response) {
  if (request.send_size() != request.receive_size()) {
    return absl::InvalidArgumentError(
        "RunTransfer local: one send bucket per receive bucket is required");
  }
  std::vector<BucketView> from, to;
  Places from_places, to_places;
  KeepAlive keep;
  {
    absl::MutexLock lock(&mu_);
    StagingBases staging_bases;
    absl::Status s =
        ReserveStagingLocked(request, response, &staging_bases, &keep);
    if (s.ok()) {
      s = ViewsLocked(request.send(), StagingBases(), /*gpu_ok=*/true, &from,
                      &from_places, &keep);
    }
    if (s.ok()) {
      s = ViewsLocked(request.receive(), staging_bases, /*gpu_ok=*/true, &to,
                      &to_places, &keep);
    }
    if (!s.ok()) return s;
  }
  absl::StatusOr<int64_t> copied =
      CopyHere(from, from_places, to, to_places, cancelled, [](int64_t) {});
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

absl::Status RemoteTransfers::RunReceive(
    const v1::RunTransferRequest& request,
    const std::function<bool()>& cancelled,
    v1::RunTransferResponse* response) {
  const absl::Time deadline =
      absl::Now() + (request.timeout_ms() > 0
                         ? absl::Milliseconds(request.timeout_ms())
                         : options_.timeout);
  std::unique_ptr<Channel> channel;
  std::unique_ptr<ChannelListener> listener;
  std::shared_ptr<FabricJoin> fabric;
  std::vector<BucketView> views;
  Places places;
  KeepAlive keep;
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
    StagingBases staging_bases;
    absl::Status s =
        ReserveStagingLocked(request, response, &staging_bases, &keep);
    if (s.ok()) {
      s = ViewsLocked(request.receive(), staging_bases,
                      /*gpu_ok=*/request.has_nccl(), &views, &places, &keep);
    }
    if (!s.ok()) return s;
  }
  absl::Status s = absl::OkStatus();
  if (request.has_nccl()) s = PinForFabric(places);
  if (s.ok() && channel == nullptr && fabric != nullptr) {
    // The NCCL channel OpenChannel began joining.
    if (!fabric->done.WaitForNotificationWithDeadline(deadline)) {
      s = absl::DeadlineExceededError(absl::StrCat(
          "RunTransfer: the NCCL channel ", request.channel_id(),
          " was not joined by the deadline"));
    } else if (!fabric->channel.ok()) {
      s = fabric->channel.status();
    } else {
      channel = *std::move(fabric->channel);
    }
  }
  if (s.ok() && channel == nullptr) {
    if (listener == nullptr) {
      return absl::FailedPreconditionError("RunTransfer: channel is busy");
    }
    while (true) {
      absl::StatusOr<std::unique_ptr<Channel>> c = listener->Accept(deadline);
      if (c.ok()) {
        channel = *std::move(c);
        break;
      }
      if (c.status().code() != absl::StatusCode::kPermissionDenied) {
        s = c.status();
        break;
      }
      LOG(WARNING) << c.status();
    }
  }
  int64_t received = 0;
  for (const BucketView& view : views) {
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

}  // namespace ferry
