#include "daemon/plans/quantizer_ranks.h"

#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/fp8_sources.h"
#include "core/validation.h"
#include "daemon/plans/fp8_quantizer.h"

namespace ferry {

void AddQuantizerRanks(const std::string& node, DeviceMemory* devices,
                       StreamPlan* out) {
  std::vector<size_t> which;
  std::vector<const ResolvedInstance*> resolved;
  std::vector<std::vector<RankLayout>> layouts;
  for (size_t i = 0; i < out->instances.size(); ++i) {
    const PlannedInstance& inst = out->instances[i];
    if (!inst.error.empty() || inst.resolved == nullptr) continue;
    if (!ReceivesQuantized(*inst.resolved)) continue;
    which.push_back(i);
    resolved.push_back(inst.resolved.get());
    layouts.push_back(*inst.layout);
  }
  if (which.empty()) return;
  auto fail = [&](const std::string& why) {
    for (size_t i : which) {
      PlannedInstance& inst = out->instances[i];
      inst.error = absl::StrCat("instance ", inst.id, ": ", why);
    }
  };
  absl::StatusOr<Fp8Sources> s =
      AddFp8Sources(out->model, out->source_layouts, resolved, &layouts);
  if (!s.ok()) return fail(std::string(s.status().message()));
  out->model = std::move(s->model);
  out->source_layouts = std::move(s->sources);
  for (size_t k = 0; k < which.size(); ++k) {
    PlannedInstance& inst = out->instances[which[k]];
    absl::Status v = ValidateDestination(out->model, layouts[k], inst.id);
    if (!v.ok()) {
      inst.error = absl::StrCat("instance ", inst.id, ": ", v.message());
      continue;
    }
    inst.layout = std::make_shared<const std::vector<RankLayout>>(
        std::move(layouts[k]));
  }
  out->fp8 = std::make_shared<Fp8Quantizer>(
      node, devices, out->stream, &out->model, &out->source_layouts, std::move(s->quantized),
      out->sources);
  for (const auto& rank : out->fp8->ranks()) out->sources.push_back(rank);
}

}  // namespace ferry
