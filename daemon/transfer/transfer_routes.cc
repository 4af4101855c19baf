#include "daemon/transfer/transfer_routes.h"

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "daemon/memory/memory_map.h"
#include "daemon/plans/fp8_quantizer.h"
#include "daemon/transfer/quantize_order.h"
#include "proto/convert.h"

namespace ferry {
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

std::vector<std::vector<Move>> MovesOf(
    const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  const std::vector<RankLayout>& layout = *pi.layout;
  std::vector<std::vector<Move>> buckets;
  if (!job.relay) {
    const InstancePlan& ip = sp.DirectPlan(pi.plan_index);
    // An exchange's part: the buckets the partner gives (from it, rank r
    // from rank r, the same piece and box: the two share one layout and
    // one copy list) or the others.
    const Exchange* exchange = job.part == TransferJob::Part::kAll
                                   ? nullptr
                                   : sp.ExchangeOf(pi.plan_index);
    const PlannedInstance* partner =
        exchange != nullptr && job.from_partner
            ? &sp.instances[sp.InstanceAtPlanIndex(exchange->partner)]
            : nullptr;
    for (size_t t = 0; t < ip.buckets.size(); ++t) {
      if (exchange != nullptr &&
          exchange->given(static_cast<int32_t>(t)) !=
              (job.part == TransferJob::Part::kGiven)) {
        continue;
      }
      const Bucket& bucket = ip.buckets[t];
      buckets.emplace_back();
      for (int32_t k = bucket.first_copy;
           k < bucket.first_copy + bucket.num_copies; ++k) {
        const Copy& c = ip.copies[k];
        if (partner != nullptr) {
          buckets.back().push_back(
              Move{partner->ranks[c.dst_rank].get(),
                   &(*partner->layout)[c.dst_rank].pieces[c.dst_piece],
                   c.dst_rank, &layout[c.dst_rank].pieces[c.dst_piece],
                   ip.BoxOf(c, layout), c.param});
          continue;
        }
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

namespace {

// The GPUs that carry a route between nodes with a box of GPU memory over
// the fabric (RunTransferRequest.nccl), by UUID: the first GPU rank's on
// each side; empty: that node's first GPU.
struct FabricEnds {
  std::string sender_gpu;
  std::string receiver_gpu;
};
using FabricRoutes = std::map<RouteKey, FabricEnds>;

// Whether `piece` of `who` is GPU memory (staging never is, here).
bool OnGpu(const Participant& who, const Piece& piece) {
  return !(piece.buffer & kStagingBufferBit) && who.memory != nullptr &&
         piece.buffer < who.memory->size() &&
         who.memory->on_device(piece.buffer);
}

// Routes between nodes with a box of GPU memory travel over the fabric.
FabricRoutes FabricRoutesOf(const TransferJob& job,
                            const std::vector<std::vector<Move>>& buckets) {
  const PlannedInstance& pi = job.plan->instances[job.instance];
  FabricRoutes fabric;
  for (const std::vector<Move>& bucket : buckets) {
    for (const Move& m : bucket) {
      const Participant& src = *m.source;
      const Participant& dst = *pi.ranks[m.dst_rank];
      if (src.node == dst.node) continue;
      const bool src_gpu = OnGpu(src, *m.src);
      const bool dst_gpu = OnGpu(dst, *m.dst);
      if (!src_gpu && !dst_gpu) continue;
      FabricEnds& ends = fabric[RouteKey(src.node, dst.node)];
      if (src_gpu && ends.sender_gpu.empty()) {
        ends.sender_gpu = src.device.cuda_uuid();
      }
      if (dst_gpu && ends.receiver_gpu.empty()) {
        ends.receiver_gpu = dst.device.cuda_uuid();
      }
    }
  }
  return fabric;
}

// Refuses a move no route can carry, before any byte moves.
absl::Status CheckMove(const TransferJob& job, const std::string& node,
                       const FabricRoutes& fabric, const Move& m) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  const Participant& src = *m.source;
  const Participant& dst = *pi.ranks[m.dst_rank];
  // The receiving GPU unpacks into staging too, which only GPU ranks have
  // pinned.
  if (src.node != dst.node && (m.dst->buffer & kStagingBufferBit) &&
      fabric.count(RouteKey(src.node, dst.node)) > 0 &&
      (dst.memory == nullptr || !dst.memory->any_on_device())) {
    return absl::UnimplementedError(absl::StrCat(
        sp.model.params[m.param].name, ": ", dst.Describe(), " (node ",
        dst.node, ") registered host memory, and its fallback staging "
        "cannot receive GPU memory from node ", src.node, " (it is not "
        "pinned for the GPUs)"));
  }
  // Relays and exchanges read the replica's live buffers; its staging
  // stays on its node (LocalExecutor relays staging on one node).
  if ((job.relay || job.from_partner) && (m.src->buffer & kStagingBufferBit)) {
    return absl::InternalError(absl::StrCat(
        pi.id, ": a relay between nodes cannot read ", src.Describe(),
        "'s staging"));
  }
  if (src.node == node && (src.memory == nullptr || !src.memory->mapped())) {
    return absl::InternalError(
        absl::StrCat(src.Describe(), ": its memory is not mapped"));
  }
  if (dst.node == node &&
      (static_cast<size_t>(m.dst_rank) >= job.destination.size() ||
       job.destination[m.dst_rank].client == nullptr)) {
    return absl::InternalError(
        absl::StrCat(dst.Describe(), ": its memory is not mapped"));
  }
  return absl::OkStatus();
}

// The request of a new route `key`: who asks, for what, over which GPUs,
// and the staging its fallback tensors need on the destination's node
// (this node: the coordinator's own, already reserved).
void StartRoute(const TransferJob& job, const std::string& node,
                absl::Duration timeout, const FabricRoutes& fabric,
                const RouteKey& key, v1::RunTransferRequest* req) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  req->set_caller_node(node);
  req->set_stream(sp.stream);
  req->set_instance_id(pi.id);
  req->set_version(job.version);
  req->set_delta_base(job.delta_base);
  req->set_timeout_ms(absl::ToInt64Milliseconds(timeout));
  auto ends = fabric.find(key);
  if (ends != fabric.end()) {
    auto* gpus = req->mutable_nccl();
    gpus->set_sender_cuda_uuid(ends->second.sender_gpu);
    gpus->set_receiver_cuda_uuid(ends->second.receiver_gpu);
  }
  if (pi.resolved == nullptr || key.second == node) return;
  for (size_t r = 0; r < pi.ranks.size(); ++r) {
    if (pi.ranks[r]->node != key.second) continue;
    const auto& fallback = pi.resolved->ranks[r].fallback;
    for (size_t k = 0; k < fallback.size(); ++k) {
      const ParamSpec spec = FallbackSpec(sp.model, fallback[k]);
      v1::StagingNeed* need = req->add_staging();
      need->set_participant_id(pi.ranks[r]->id);
      need->set_slot(static_cast<int32_t>(k));
      need->set_parameter(spec.name);
      need->set_bytes(BoxBytes(FullBox(spec.shape), spec.dtype));
    }
  }
}

// Opens bucket `id` of `route` on each list the route keeps: the wire's
// receive part, and the views of this node's sources (and destinations,
// for a route on this node) or else the wire's send part.
void StartBucket(uint64_t id, bool here, bool local_here, NodeRoute* route) {
  route->req.add_receive()->set_id(id);
  if (!here) {
    route->req.add_send()->set_id(id);
    return;
  }
  route->views.emplace_back();
  route->views.back().id = id;
  route->view_places.emplace_back();
  if (local_here) {
    route->local.emplace_back();
    route->local.back().id = id;
    route->local_places.emplace_back();
  }
}

// Adds move `m` to bucket `at` of its route: the destination box on the
// wire, and the source box as a view of memory mapped here (with the
// destination's, for a route on this node) or on the wire for its node.
absl::Status AddMove(const TransferJob& job, const std::string& node,
                     const Move& m, int at, NodeRoute* route) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  const Participant& source = *m.source;
  const bool here = source.node == node;
  const bool local_here = here && pi.ranks[m.dst_rank]->node == node;
  const Piece& src = *m.src;
  const Piece& dst = *m.dst;
  const DType dtype = sp.model.params[m.param].dtype;
  const Box& box = m.box;
  const Dims extent = StorageBox(box, dtype).extent;
  const int64_t unit = UnitBytes(dtype);
  const int64_t bytes = BoxBytesOf(extent, unit);
  route->bytes += bytes;
  AddBox(route->req.mutable_receive(at), pi.ranks[m.dst_rank]->id,
         dst.buffer, ByteOffsetOf(dst, box, dtype), dst.strides, extent, unit);
  if (!here) {
    AddBox(route->req.mutable_send(at), source.id, src.buffer,
           ByteOffsetOf(src, box, dtype), src.strides, extent, unit);
    return absl::OkStatus();
  }
  const MemoryMap& src_memory = *source.memory;
  if (src.buffer >= src_memory.size()) {
    return absl::InternalError(absl::StrCat(
        source.Describe(), ": buffer ", src.buffer, " is not mapped"));
  }
  BucketView& view = route->views[at];
  RegionView region;
  region.base = src_memory.base(src.buffer) + ByteOffsetOf(src, box, dtype);
  region.strides = src.strides;
  view.regions.push_back(region);
  view.extents.push_back(extent);
  view.unit_bytes.push_back(unit);
  view.bytes += bytes;
  route->view_places[at].push_back(PlaceIn(src_memory, src.buffer));
  if (!local_here) return absl::OkStatus();
  const BufferPlace dst_place = job.destination[m.dst_rank].Find(dst.buffer);
  if (dst_place.base == nullptr) {
    return absl::InternalError(
        absl::StrCat(pi.ranks[m.dst_rank]->Describe(), ": buffer ",
                     dst.buffer, " is not mapped"));
  }
  BucketView& to = route->local[at];
  RegionView d;
  d.base = dst_place.base + ByteOffsetOf(dst, box, dtype);
  d.strides = dst.strides;
  to.regions.push_back(d);
  to.extents.push_back(extent);
  to.unit_bytes.push_back(unit);
  to.bytes += bytes;
  route->local_places[at].push_back(dst_place);
  return absl::OkStatus();
}

bool IsQuantizerRank(const Fp8Quantizer& fp8, const Participant* p) {
  for (const auto& rank : fp8.ranks()) {
    if (rank.get() == p) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<NodeRoutes> BuildRoutes(
    const TransferJob& job, const std::string& node, absl::Duration timeout,
    const std::function<uint64_t()>& next_bucket_id) {
  const PlannedInstance& pi = job.plan->instances[job.instance];
  const std::vector<std::vector<Move>> buckets = MovesOf(job);
  const FabricRoutes fabric = FabricRoutesOf(job, buckets);
  for (const std::vector<Move>& bucket : buckets) {
    for (const Move& m : bucket) {
      absl::Status s = CheckMove(job, node, fabric, m);
      if (!s.ok()) return s;
    }
  }
  // One route per (source node, destination node), each bucket split by
  // route (plan order).
  NodeRoutes out;
  // FP8 in flight: the tensors each route reads from a member's quantizer
  // rank, which that member quantizes first (route_quantizers.h).
  const Fp8Quantizer* fp8 = job.plan->fp8.get();
  std::map<RouteKey, std::pair<const Participant*, std::set<size_t>>> orders;
  for (const std::vector<Move>& bucket : buckets) {
    std::map<RouteKey, int> part;  // route -> index in its buckets
    for (const Move& m : bucket) {
      const RouteKey key(m.source->node, pi.ranks[m.dst_rank]->node);
      if (fp8 != nullptr && m.source->node != node &&
          IsQuantizerRank(*fp8, m.source)) {
        const QuantizedParam* q = fp8->OfDerived(m.param);
        auto& order = orders[key];
        order.first = m.source;
        if (q != nullptr) order.second.insert(q - fp8->quantized().data());
      }
      auto [it, fresh] = out.by_key.try_emplace(key);
      NodeRoute& route = it->second;
      if (fresh) {
        out.order.push_back(key);
        StartRoute(job, node, timeout, fabric, key, &route.req);
      }
      auto [at, added] = part.try_emplace(key, route.req.receive_size());
      if (added) {
        StartBucket(next_bucket_id(), key.first == node,
                    key.first == node && key.second == node, &route);
      }
      absl::Status s = AddMove(job, node, m, at->second, &route);
      if (!s.ok()) return s;
    }
  }
  for (const auto& [key, order] : orders) {
    AddQuantizeOrder(job, *order.first, order.second, &out.by_key[key].req);
  }
  return out;
}

bool ReachesOtherNodes(const TransferJob& job, const std::string& node) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  for (const auto& r : pi.ranks) {
    if (r != nullptr && r->node != node) return true;
  }
  if (job.relay) {
    // Ranks all here, the replica it relays from (some) on a member.
    const PlannedInstance& from = sp.instances[sp.InstanceAtPlanIndex(
        sp.plan.instances[pi.plan_index].relay_from)];
    for (const auto& r : from.ranks) {
      if (r != nullptr && r->node != node) return true;
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
      if (r != nullptr && r->node != node) return true;
    }
    return false;
  }
  // Ranks all here, sources (some) on a member: that member sends.
  for (const Copy& c : sp.DirectPlan(pi.plan_index).copies) {
    const auto& src = sp.sources[c.src_rank];
    if (src != nullptr && src->node != node) return true;
  }
  return false;
}

void AddStagingHere(const TransferJob& job, const std::string& node,
                    std::map<std::string, v1::ParticipantStaging>* staging) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  // Ranks on this node: the coordinator's own staging.
  for (size_t r = 0; r < pi.ranks.size(); ++r) {
    if (pi.ranks[r]->node != node) continue;
    if (r >= job.destination.size() || job.destination[r].staging == nullptr) {
      continue;
    }
    const StagingArea& area = *job.destination[r].staging;
    v1::ParticipantStaging& ps = (*staging)[pi.ranks[r]->id];
    ps.set_participant_id(pi.ranks[r]->id);
    for (v1::MemoryRegion& region : area.Exported()) {
      *ps.add_regions() = std::move(region);
    }
    if (pi.resolved == nullptr) continue;
    for (const FallbackTensor& f : pi.resolved->ranks[r].fallback) {
      const std::string name = FallbackSpec(sp.model, f).name;
      const StagingArea::Slot* slot = area.Find(name);
      if (slot == nullptr) continue;
      v1::StagingSlot* ss = ps.add_slots();
      ss->set_parameter(name);
      ss->set_region_id(slot->region_id);
      ss->set_bytes(slot->bytes);
    }
  }
}

std::vector<v1::ApplyDetail> ApplyDetailsOf(
    const TransferJob& job,
    const std::map<std::string, v1::ParticipantStaging>& staging) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  std::vector<v1::ApplyDetail> details(pi.ranks.size());
  for (size_t r = 0; r < pi.ranks.size(); ++r) {
    v1::ApplyDetail& apply = details[r];
    auto found = staging.find(pi.ranks[r]->id);
    if (found == staging.end()) continue;
    const v1::ParticipantStaging& ps = found->second;
    *apply.mutable_staging_regions() = ps.regions();
    if (pi.resolved == nullptr) continue;
    for (const FallbackTensor& f : pi.resolved->ranks[r].fallback) {
      const ParamSpec spec = FallbackSpec(sp.model, f);
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
  return details;
}

}  // namespace ferry
