#include "daemon/transfer/route_memory.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/piece.h"

namespace ferry {

RouteMemory::RouteMemory(const RouteOptions& options)
    : node_(options.node),
      devices_(options.devices),
      max_staging_bytes_(options.max_staging_bytes) {}

void RouteMemory::AddLocal(const std::string& participant_id,
                           std::shared_ptr<const MemoryMap> memory) {
  absl::MutexLock lock(&mu_);
  local_[participant_id] = std::move(memory);
}

void RouteMemory::RemoveLocal(const std::string& participant_id) {
  absl::MutexLock lock(&mu_);
  local_.erase(participant_id);
  staging_.erase(participant_id);
  derived_.erase(participant_id);
  auto readers = readers_.find(participant_id);
  if (readers == readers_.end()) return;
  for (const std::string& id : readers->second) {
    local_.erase(id);
    derived_.erase(id);
  }
  readers_.erase(readers);
}

void RouteMemory::AddDerived(const std::string& id,
                             std::shared_ptr<const MemoryMap> memory,
                             const std::vector<std::string>& reads) {
  absl::MutexLock lock(&mu_);
  local_[id] = std::move(memory);
  derived_.insert(id);
  for (const std::string& r : reads) readers_[r].insert(id);
}

int64_t RouteMemory::LocalBytes() {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [id, memory] : local_) {
    if (memory != nullptr && derived_.count(id) == 0) {
      total += memory->total_bytes();
    }
  }
  return total;
}

std::shared_ptr<const MemoryMap> RouteMemory::LocalMemory(
    const std::string& participant_id) {
  absl::MutexLock lock(&mu_);
  auto it = local_.find(participant_id);
  return it == local_.end() ? nullptr : it->second;
}

int64_t RouteMemory::StagingBytesInUse() {
  absl::MutexLock lock(&mu_);
  int64_t held = 0;
  for (const auto& [id, area] : staging_) {
    if (area != nullptr) held += area->reserved_bytes();
  }
  return held;
}

void RouteMemory::Expect(const std::string& participant_id,
                         RankMemory memory) {
  absl::MutexLock lock(&mu_);
  receiving_[participant_id] = std::move(memory);
}

void RouteMemory::Unexpect(const std::string& participant_id) {
  absl::MutexLock lock(&mu_);
  receiving_.erase(participant_id);
}

absl::Status RouteMemory::ViewsOf(const v1::RunTransferRequest& request,
                                  bool reserve, bool gpu_ok,
                                  v1::RunTransferResponse* response,
                                  RouteViews* send, RouteViews* receive,
                                  KeepAlive* keep) {
  absl::MutexLock lock(&mu_);
  StagingBases staging_bases;
  if (reserve) {
    absl::Status s =
        ReserveStagingLocked(request, response, &staging_bases, keep);
    if (!s.ok()) return s;
  }
  if (send != nullptr) {
    // A sender's boxes are live buffers: no staging of this request's.
    absl::Status s =
        ViewsLocked(request.send(), StagingBases(), gpu_ok, send, keep);
    if (!s.ok()) return s;
  }
  if (receive != nullptr) {
    absl::Status s =
        ViewsLocked(request.receive(), staging_bases, gpu_ok, receive, keep);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status RouteMemory::ReserveStagingLocked(
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
  if (max_staging_bytes_ >= 0 && !needs.empty()) {
    int64_t others = 0;
    for (const auto& [id, area] : staging_) {
      if (area != nullptr && needs.count(id) == 0) {
        others += area->reserved_bytes();
      }
    }
    if (wanted > max_staging_bytes_ - others) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "node ", node_, ": its ranks need ", wanted,
          " bytes of staging for their fallback tensors; with the ", others,
          " bytes other ranks there hold, that is over its staging limit of ",
          max_staging_bytes_, " bytes (--max_staging_mb)"));
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
          id, gpu_rank ? devices_ : nullptr);
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
      place.base = slot->data();
      place.pinned = area->pinned();
      place.gpu = area->gpu();
      (*staging_bases)[id][k] = place;
      v1::StagingSlot* ss = out->add_slots();
      ss->set_parameter(name);
      ss->set_region_id(slot->region_id);
      ss->set_bytes(slot->bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status RouteMemory::ViewsLocked(
    const google::protobuf::RepeatedPtrField<v1::TransferBucket>& buckets,
    const StagingBases& staging_bases, bool gpu_ok, RouteViews* out,
    KeepAlive* keep) {
  std::vector<BucketView>* views = &out->views;
  Places* places = &out->places;
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
            " did not register through node ", node_));
      } else if (m->second->released()) {
        // Offloaded (member_memory.h): the protocol sends it nothing.
        return absl::FailedPreconditionError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(), " on node ",
            node_, " released its memory (Lifecycle.Offload)"));
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

absl::StatusOr<int64_t> CopyViews(
    const CopyRouter& router, const std::vector<BucketView>& from,
    Places& from_places,
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
          router.EngineFor(from_places[i][j], to_places[i][j]);
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
    absl::Status s = router.Run(batch);
    if (!s.ok()) return s;
    copied += to[i].bytes;
    on_bytes(to[i].bytes);
  }
  return copied;
}

absl::Status PinForFabric(Places& places, DeviceMemory* devices) {
  for (std::vector<BufferPlace>& bucket : places) {
    for (BufferPlace& place : bucket) {
      if (place.on_gpu() || place.pinned) continue;
      if (place.map == nullptr) {
        return absl::UnimplementedError(
            "a host rank's fallback staging cannot receive GPU memory from "
            "another node (it is not pinned for the GPUs)");
      }
      absl::Status s = place.map->PinForGpus(place.index, devices);
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

}  // namespace ferry
