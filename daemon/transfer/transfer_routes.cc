#include "daemon/transfer/transfer_routes.h"

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "daemon/memory/memory_map.h"
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

absl::StatusOr<NodeRoutes> BuildRoutes(
    const TransferJob& job, const std::string& node, absl::Duration timeout,
    const std::function<uint64_t()>& next_bucket_id) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  const std::vector<std::vector<Move>> buckets = MovesOf(job);
  // Routes between nodes with a box of GPU memory travel over NCCL, on
  // the GPU of the first GPU rank on each side (else the node's first).
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
    // Relays and exchanges read the replica's live buffers; its staging
    // stays on its node (LocalExecutor relays staging on one node).
    if ((job.relay || job.from_partner) &&
        (m.src->buffer & kStagingBufferBit)) {
      return absl::InternalError(absl::StrCat(
          pi.id, ": a relay between nodes cannot read ", src.Describe(),
          "'s staging"));
    }
    if (src.node == node &&
        (src.memory == nullptr || !src.memory->mapped())) {
      return absl::InternalError(
          absl::StrCat(src.Describe(), ": its memory is not mapped"));
    }
    if (dst.node == node &&
        (static_cast<size_t>(m.dst_rank) >= job.destination.size() ||
         job.destination[m.dst_rank].client == nullptr)) {
      return absl::InternalError(
          absl::StrCat(dst.Describe(), ": its memory is not mapped"));
    }
   }
  }
  // One route per (source node, destination node), each bucket split by
  // route (plan order).
  NodeRoutes out;
  std::map<RouteKey, NodeRoute>& routes = out.by_key;
  std::vector<RouteKey>& order = out.order;
  auto route_of = [&](const RouteKey& key) -> NodeRoute& {
    auto it = routes.find(key);
    if (it != routes.end()) return it->second;
    order.push_back(key);
    NodeRoute& route = routes[key];
    v1::RunTransferRequest& req = route.req;
    req.set_caller_node(node);
    req.set_stream(sp.stream);
    req.set_instance_id(pi.id);
    req.set_timeout_ms(absl::ToInt64Milliseconds(timeout));
    auto nccl = nccl_routes.find(key);
    if (nccl != nccl_routes.end()) *req.mutable_nccl() = nccl->second;
    // Staging for fallback tensors, reserved on the destination's node
    // (this node: the coordinator's own, already reserved).
    if (pi.resolved != nullptr && key.second != node) {
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
      const bool here = source.node == node;
      const RouteKey key(source.node, pi.ranks[m.dst_rank]->node);
      const bool local_here = here && key.second == node;
      NodeRoute& route = route_of(key);
      auto [at, added] = part.try_emplace(key, route.req.receive_size());
      if (added) {
        const uint64_t id = next_bucket_id();
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

  return out;
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
  return details;
}

}  // namespace ferry
