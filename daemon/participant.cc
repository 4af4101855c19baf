#include "daemon/participant.h"

#include "absl/strings/str_cat.h"

namespace ferry {

std::string Participant::Describe() const {
  if (role == Role::kSource) {
    return absl::StrCat("source ", stream, " rank ", rank);
  }
  return absl::StrCat("instance ", instance_id, " tp rank ", tp_rank);
}

std::unique_ptr<Participant> Participant::WithMemory(
    std::shared_ptr<const MemoryMap> new_memory,
    std::vector<v1::MemoryRegion> new_regions) const {
  auto p = std::make_unique<Participant>();
  p->id = id;
  p->token = token;
  p->role = role;
  p->stream = stream;
  p->node = node;
  p->device = device;
  p->pid = pid;
  p->registered_at = registered_at;
  p->owner_known = owner_known;
  p->owner_uid = owner_uid;
  p->rank = rank;
  p->world_size = world_size;
  p->params = params;
  p->instance_id = instance_id;
  p->tp_rank = tp_rank;
  p->tp_size = tp_size;
  p->held_version = held_version;
  p->engine_table = engine_table;
  p->engine_params = engine_params;
  p->piece_params = piece_params;
  p->pieces = pieces;
  p->memory = std::move(new_memory);
  p->regions = std::move(new_regions);
  return p;
}

}  // namespace ferry
