#include "daemon/plans/donor_plan.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/planner.h"

namespace ferry {

std::string DonorUnfitReason(const StreamPlan& sp, int32_t donor) {
  const PlannedInstance& p = sp.instances[donor];
  if (!p.error.empty() || p.layout == nullptr) {
    return absl::StrCat("instance ", p.id, " is not planned: ", p.error);
  }
  for (const RankLayout& rank : *p.layout) {
    for (const Piece& piece : rank.pieces) {
      if (piece.buffer & kStagingBufferBit) {
        return absl::StrCat(
            "instance ", p.id, " receives ", sp.model.params[piece.param].name,
            " through its loader (fallback staging), so it does not hold "
            "those bytes in its buffers");
      }
    }
  }
  for (const auto& r : p.ranks) {
    if (r->removed.load()) {
      return absl::StrCat("instance ", p.id, " tp rank ", r->tp_rank,
                          " is no longer registered");
    }
  }
  return "";
}

absl::StatusOr<std::shared_ptr<const StreamPlan>> BuildDonorPlan(
    const StreamPlan& sp, int32_t donor, int32_t target) {
  const std::string unfit = DonorUnfitReason(sp, donor);
  if (!unfit.empty()) return absl::FailedPreconditionError(unfit);
  const PlannedInstance& t = sp.instances[target];
  if (!t.error.empty() || t.layout == nullptr) {
    return absl::InvalidArgumentError(t.error);
  }
  auto out = std::make_shared<StreamPlan>();
  out->stream = sp.stream;
  out->epoch = sp.epoch;
  out->model = sp.model;
  const PlannedInstance& p = sp.instances[donor];
  out->sources = p.ranks;
  for (size_t r = 0; r < p.ranks.size(); ++r) {
    RankLayout layout = (*p.layout)[r];
    layout.rank = static_cast<int32_t>(r);
    layout.node = p.ranks[r]->node;
    layout.buffer_bytes = p.ranks[r]->memory->sizes();
    layout.buffer_ids = p.ranks[r]->memory->ids();
    out->source_layouts.push_back(std::move(layout));
  }
  PlannedInstance target_copy = t;
  target_copy.plan_index = 0;
  out->instances.push_back(std::move(target_copy));
  PlanOptions direct;
  direct.relay = false;
  absl::StatusOr<Plan> plan = PlanTransfers(
      out->model, out->source_layouts,
      {Instance{t.id, t.layout, {}}}, direct);
  if (!plan.ok()) {
    // The donor's layout validated as a destination; as a source it must
    // also tile every parameter, which a donor that holds only some of them
    // (a partial engine table) does not.
    return absl::FailedPreconditionError(absl::StrCat(
        "instance ", p.id, " cannot serve as a peer: ",
        plan.status().message()));
  }
  out->plan = *std::move(plan);
  return std::shared_ptr<const StreamPlan>(std::move(out));
}

}  // namespace ferry
