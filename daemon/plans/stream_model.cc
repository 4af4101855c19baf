#include "daemon/plans/stream_model.h"

#include <algorithm>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/parallel_for.h"

namespace ferry {

ModelSpec StreamModel(const Registry::StreamSnapshot& s) {
  if (s.sources_complete() && s.declared_model != nullptr) {
    // The registry's union of what the sources declare: merging every
    // rank's own list again (256 ranks x 140,000 names for Kimi-K2) was
    // most of a plan's cost.
    ModelSpec model;
    model.params = *s.declared_model;
    // The registry keeps it in name order; names are unique, so any sort
    // gives the same order, and one is needed only if that ever changes.
    auto by_name = [](const ParamSpec& a, const ParamSpec& b) {
      return a.name < b.name;
    };
    if (!std::is_sorted(model.params.begin(), model.params.end(), by_name)) {
      ParallelStableSort(model.params.begin(), model.params.end(),
                         PlanningThreads(), by_name);
    }
    model.BuildIndex();  // in name order: no index to build
    return model;
  }
  std::map<std::string, ParamSpec> by_name;
  const bool retained = !s.sources_complete() && s.retained_model != nullptr;
  if (retained) {
    for (const ParamSpec& p : *s.retained_model) by_name.emplace(p.name, p);
  }
  for (const auto& src : s.sources) {
    if (src == nullptr || retained) continue;
    for (const ParamSpec& p : *src->params) by_name.emplace(p.name, p);
  }
  ModelSpec model;
  for (auto& [name, p] : by_name) model.params.push_back(p);
  model.BuildIndex();
  return model;
}

std::string MissingSourcesError(const Registry::StreamSnapshot& s) {
  std::vector<int32_t> missing;
  for (int32_t r = 0; r < s.world_size; ++r) {
    if (r >= static_cast<int32_t>(s.sources.size()) || !s.sources[r]) {
      missing.push_back(r);
    }
  }
  return s.world_size == 0
             ? absl::StrCat("stream ", s.name, " has no source registered")
             : absl::StrCat("stream ", s.name, ": source ranks [",
                            absl::StrJoin(missing, ", "), "] of world_size ",
                            s.world_size, " are not registered");
}

std::vector<RankLayout> SourceLayouts(const Registry::StreamSnapshot& s,
                                      const ModelSpec& model) {
  // Ranks that declared an equal list share it (table_interner.h): its
  // indices are mapped to the model's once per list, not once per piece.
  std::map<const std::vector<ParamSpec>*, std::vector<int32_t>> model_index;
  for (const auto& src : s.sources) {
    std::vector<int32_t>& to_model = model_index[src->params.get()];
    if (to_model.empty()) {
      for (const ParamSpec& spec : *src->params) {
        to_model.push_back(model.Find(spec.name));
      }
    }
  }
  // Each rank's pieces in the model's indices, rank by rank on the
  // planning threads (1.3 million pieces for Kimi-K2's 256 ranks).
  std::vector<RankLayout> layouts(s.sources.size());
  ParallelFor(s.sources.size(), PlanningThreads(), [&](size_t k) {
    const auto& src = s.sources[k];
    const std::vector<int32_t>& to_model =
        model_index.find(src->params.get())->second;
    RankLayout& r = layouts[k];
    r.rank = src->rank;
    r.node = src->node;
    r.buffer_bytes = src->memory->sizes();
    r.buffer_ids = src->memory->ids();
    r.pieces.reserve(src->pieces.size());
    for (Piece piece : src->pieces) {
      piece.param = to_model[piece.param];
      r.pieces.push_back(std::move(piece));
    }
  });
  return layouts;
}

}  // namespace ferry
