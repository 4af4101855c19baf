#include "daemon/lifecycle/adapter_ranks.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "daemon/memory/staging_area.h"

namespace ferry {
namespace {

// Shares start at multiples of this in an adapter's staging, so an engine
// can view each as a tensor without copying.
constexpr int64_t kShareAlignment = 256;

}  // namespace

void LayOutAdapterShares(const std::vector<AdapterShare>& shares,
                         const std::vector<ParamSpec>& tensors,
                         AdapterBinding* binding, Participant* p) {
  int64_t offset = 0;
  for (const AdapterShare& s : shares) {
    const ParamSpec& t = tensors[s.tensor];
    AdapterBinding::Share share;
    share.parameter = t.name;
    share.dtype = t.dtype;
    share.shape = t.shape;
    share.box = s.box;
    share.whole = s.whole;
    share.byte_offset = offset;
    share.bytes = BoxBytes(s.box, t.dtype);
    p->piece_params.push_back(t.name);
    p->pieces.push_back(Piece::Contiguous(
        static_cast<int32_t>(p->piece_params.size() - 1), s.box, 0, offset,
        t.dtype));
    offset += (share.bytes + kShareAlignment - 1) / kShareAlignment *
              kShareAlignment;
    binding->shares.push_back(std::move(share));
  }
  binding->bytes = std::max<int64_t>(offset, 1);
}

absl::Status MakeAdapterStaging(const ManageRemoteMemory& remote_memory,
                                bool on_member, const Participant& engine,
                                const std::string& rank_id,
                                const std::string& staging_name,
                                const std::string& who_rank,
                                AdapterBinding* binding) {
  if (on_member) {
    // The member makes the staging and writes it; here only its shape.
    v1::ManageMemoryRequest stage;
    stage.set_action(v1::MEMORY_ACTION_STAGE_ADAPTER);
    stage.add_participant_ids(rank_id);
    stage.set_bytes(binding->bytes);
    stage.set_engine_participant_id(engine.id);
    absl::StatusOr<v1::ManageMemoryResponse> staged =
        remote_memory(engine.node, stage);
    if (!staged.ok()) {
      return absl::Status(staged.status().code(),
                          absl::StrCat(who_rank, ": ",
                                       staged.status().message()));
    }
    binding->exported = staged->region();
    return absl::OkStatus();
  }
  binding->staging = std::make_shared<StagingArea>(staging_name);
  absl::Status s = binding->staging->Reserve({{"shares", binding->bytes}});
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(who_rank, ": ", s.message()));
  }
  binding->exported = binding->staging->Exported()[0];
  return absl::OkStatus();
}

absl::Status MapAdapterRank(const Participant& engine,
                            const std::string& adapter_stream,
                            const std::string& instance, const std::string& who,
                            const MapOptions& map_options,
                            std::shared_ptr<AdapterBinding> binding,
                            Participant* p) {
  google::protobuf::RepeatedPtrField<v1::MemoryRegion> regions;
  v1::MemoryRegion* region = regions.Add();
  *region = binding->exported;
  region->set_region_id(0);
  absl::StatusOr<std::unique_ptr<MemoryMap>> map =
      MemoryMap::Map(regions, who, map_options);
  if (!map.ok()) return map.status();
  p->role = Role::kDestination;
  p->stream = adapter_stream;
  p->node = engine.node;
  p->device = engine.device;
  p->owner_known = engine.owner_known;
  p->owner_uid = engine.owner_uid;
  p->instance_id = instance;
  p->tp_rank = engine.tp_rank;
  p->tp_size = engine.tp_size;
  p->memory = *std::move(map);
  p->regions.push_back(*region);
  p->adapter = std::move(binding);
  return absl::OkStatus();
}

}  // namespace ferry
