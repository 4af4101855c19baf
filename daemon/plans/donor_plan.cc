#include "daemon/plans/donor_plan.h"

#include <algorithm>
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

namespace {

// Narrows `out` (a donor plan being built: its model, its donor's source
// layouts) to the parameters the donor holds, renumbered, when it does not
// hold them all (an FP8 instance holds the quantized tensors, not the
// trainer's bf16 ones), and returns the target's layout in those numbers.
// The stream's own layout when the donor holds every parameter.
// FAILED_PRECONDITION naming a parameter the target needs that the donor
// does not hold, or a target with fallback tensors (their staging is
// numbered in the stream's model).
absl::StatusOr<std::shared_ptr<const std::vector<RankLayout>>> NarrowToDonor(
    const PlannedInstance& donor, const PlannedInstance& target,
    StreamPlan* out) {
  std::vector<int32_t> renumber(out->model.params.size(), -1);
  for (const RankLayout& rank : out->source_layouts) {
    for (const Piece& piece : rank.pieces) renumber[piece.param] = 0;
  }
  if (std::find(renumber.begin(), renumber.end(), -1) == renumber.end()) {
    return target.layout;
  }
  if (target.resolved != nullptr) {
    for (const ResolvedRank& r : target.resolved->ranks) {
      if (!r.fallback.empty()) {
        return absl::FailedPreconditionError(absl::StrCat(
            "instance ", donor.id, " holds only some of the stream's "
            "parameters, and instance ", target.id, " receives tensors "
            "through its loader"));
      }
    }
  }
  ModelSpec narrow;
  for (size_t i = 0; i < renumber.size(); ++i) {
    if (renumber[i] < 0) continue;
    renumber[i] = static_cast<int32_t>(narrow.params.size());
    narrow.params.push_back(out->model.params[i]);
  }
  narrow.BuildIndex();
  for (RankLayout& rank : out->source_layouts) {
    for (Piece& piece : rank.pieces) piece.param = renumber[piece.param];
  }
  auto layout = std::make_shared<std::vector<RankLayout>>(*target.layout);
  for (RankLayout& rank : *layout) {
    for (Piece& piece : rank.pieces) {
      if (renumber[piece.param] < 0) {
        return absl::FailedPreconditionError(absl::StrCat(
            "instance ", donor.id, " does not hold ",
            out->model.params[piece.param].name, ", which instance ",
            target.id, " needs"));
      }
      piece.param = renumber[piece.param];
    }
  }
  out->model = std::move(narrow);
  return std::shared_ptr<const std::vector<RankLayout>>(std::move(layout));
}

}  // namespace

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
  // An FP8 donor holds the quantized tensors, not the trainer's: the plan
  // covers what it holds.
  absl::StatusOr<std::shared_ptr<const std::vector<RankLayout>>> layout =
      NarrowToDonor(p, t, out.get());
  if (!layout.ok()) return layout.status();
  PlannedInstance target_copy = t;
  target_copy.plan_index = 0;
  target_copy.layout = *layout;
  out->instances.push_back(std::move(target_copy));
  PlanOptions direct;
  direct.relay = false;
  absl::StatusOr<Plan> plan = PlanTransfers(
      out->model, out->source_layouts,
      {Instance{t.id, *layout, {}}}, direct);
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
