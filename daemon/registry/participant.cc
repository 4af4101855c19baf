#include "daemon/registry/participant.h"

#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"

namespace ferry {

std::string Participant::Describe() const {
  if (role == Role::kSource) {
    return absl::StrCat("source ", stream, " rank ", rank);
  }
  if (adapter != nullptr) {
    return absl::StrCat("adapter ", adapter->name, " of instance ",
                        adapter->base_instance, " tp rank ", tp_rank);
  }
  return absl::StrCat("instance ", instance_id, " tp rank ", tp_rank);
}

std::vector<std::string> Participant::NeededNames() const {
  std::vector<std::string> names;
  if (!engine_table) return piece_params;
  // An FP8 weight's scale tensor is filled with the weight's blocks: it
  // names no checkpoint parameter of its own.
  absl::flat_hash_set<absl::string_view> scales;
  for (const EngineParam& e : *engine_params) {
    if (e.fp8.declared()) scales.insert(e.fp8.scale);
  }
  for (const EngineParam& e : *engine_params) {
    if (!e.alias_of.empty()) continue;  // written through its target
    if (scales.contains(e.name)) continue;
    const bool fused = e.loader == LoaderKind::kFused && !e.parts.empty();
    if (fused) {
      for (const FusedPart& part : e.parts) names.push_back(part.checkpoint_name);
    }
    for (const std::string& c : e.consumes) names.push_back(c);
    if (!fused && e.consumes.empty()) names.push_back(e.name);
  }
  return names;
}

std::unique_ptr<Participant> Participant::WithMemory(
    std::shared_ptr<const MemoryMap> new_memory,
    std::vector<v1::MemoryRegion> new_regions) const {
  auto p = std::make_unique<Participant>(*this);
  p->memory = std::move(new_memory);
  p->regions = std::move(new_regions);
  return p;
}

}  // namespace ferry
