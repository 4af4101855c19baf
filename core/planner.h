// The planner: from sources and destination instances to a Plan.
//
// Every destination byte gets exactly one source. Among the replicas of a
// source shard (DP ranks), a destination prefers one on its own node, then
// the one with the fewest bytes to send to this instance (the shards it
// alone holds, and those chosen so far), then the lowest rank: bytes spread
// over replicas and stay on a node when they can. Each instance is planned
// on its own, so replicas on nodes without sources plan alike and share
// their copies (SourcePlanner::ReadAlike). A destination
// piece that matches a source shard box for box (TP-matched layouts) is one
// whole-piece copy: rank to rank, no gather. A fallback tensor is assembled
// in the destination's staging from the shards that hold it, never gathered
// on one source first.
#ifndef FERRY_CORE_PLANNER_H_
#define FERRY_CORE_PLANNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "core/plan.h"
#include "core/validation.h"

namespace ferry {

struct PlanOptions {
  // Largest bucket (staging buffer) in bytes; larger copies are split.
  int64_t bucket_bytes = int64_t{64} << 20;
  // Replicas of a layout relay from each other instead of each receiving
  // every byte from the trainer.
  bool relay = true;
  // The caller validated every instance's layout (ValidateDestination)
  // and it has not changed since: the planner does not repeat it. ferryd's
  // PlanCache does, once per distinct layout, before it plans twice.
  bool destinations_validated = false;
};

// The sources of one membership, validated and indexed once, from which
// any number of plans are made. ferryd keeps one per stream plan: it plans
// every instance with relays up front, and a relayed replica's copies from
// the sources only when it needs them (its relay failed, or ferryd does
// not run that relay), one instance at a time.
//
// Thread-safe once created: planning reads the index and writes only its
// own output. `model` and `sources` are not copied and must outlive it.
class SourcePlanner {
 public:
  // Validates the model and the sources (they tile every parameter).
  // Errors are INVALID_ARGUMENT naming the parameter, rank and box.
  static absl::StatusOr<std::unique_ptr<const SourcePlanner>> Create(
      const ModelSpec& model, const std::vector<RankLayout>& sources,
      const PlanOptions& options = PlanOptions());

  // Validates every instance (unless options.destinations_validated) and
  // plans each: relayed from an earlier replica of its layout class (with
  // options.relay), or from the sources, sharing the copies of an earlier
  // instance it reads alike with.
  absl::StatusOr<Plan> PlanInstances(
      const std::vector<Instance>& instances) const;

  // The copies of one instance from the sources, never relayed. Every
  // instance is planned on its own (holder load counts its own bytes), so
  // this is its plan in PlanInstances too, when it does not relay. The
  // same as PlanInstances({instance}) with relay off, without the
  // validation: REQUIRES the layout passed ValidateDestination.
  InstancePlan PlanAlone(const Instance& instance) const;

  // Whether two instances read the same source boxes in the same order:
  // equal layouts, and the same ranks share a node with each other and
  // with the same sources (a holder on the destination's node is
  // preferred). Replicas on nodes without sources, one TP group per set of
  // nodes, read alike.
  bool ReadAlike(const Instance& a, const Instance& b) const;

  // The plan of `instance` from `like`, the plan from the sources of an
  // instance it ReadAlike: the same copies, boxes and buckets (shared, not
  // copied), its own routes' node names. What PlanAlone would give.
  InstancePlan PlanAlike(const InstancePlan& like,
                         const Instance& instance) const;

  // What instance k of `plan` (PlanInstances over `instances`) reads from
  // the sources: its copies in `plan` when it does not relay; for a
  // relayed replica (planned when ferryd does not run its relay), the
  // copies of its tree's root, shared, when the two read alike (the usual
  // case: replicas on nodes without sources), else PlanAlone's.
  InstancePlan PlanFromSourcesOf(const Plan& plan,
                                 const std::vector<Instance>& instances,
                                 int32_t k) const;

  // The sources' shards and their holders, as Create validated them.
  const SourceIndex& index() const { return index_; }

 private:
  SourcePlanner(const ModelSpec& model, const std::vector<RankLayout>& sources,
                const PlanOptions& options, SourceIndex index)
      : model_(model), sources_(sources), options_(options),
        index_(std::move(index)) {}

  // Per destination rank: the id of its node among the sources' nodes
  // (negative), or the first rank on its node: what PlanFromSources's
  // choices depend on besides the layout.
  std::vector<int64_t> Signature(const Instance& instance) const;

  const ModelSpec& model_;
  const std::vector<RankLayout>& sources_;
  const PlanOptions options_;
  const SourceIndex index_;
  std::unordered_map<std::string, int32_t> source_node_id_;  // set in Create
  // By source rank: bytes of the shards it alone holds (set in Create).
  std::vector<int64_t> fixed_load_;
};

// Validates everything (model, sources, every instance) and plans:
// SourcePlanner::Create, then PlanInstances. Errors are INVALID_ARGUMENT
// naming the parameter, rank and box.
absl::StatusOr<Plan> PlanTransfers(const ModelSpec& model,
                                   const std::vector<RankLayout>& sources,
                                   const std::vector<Instance>& instances,
                                   const PlanOptions& options = PlanOptions());

// Splits `box` (elements) into boxes of at most `max_bytes` each, cutting
// along the outermost dims first and never inside a quantization block.
// Appends to `out` in row-major order.
void SplitBox(const Box& box, DType dtype, int64_t max_bytes,
              std::vector<Box>* out);

}  // namespace ferry

#endif  // FERRY_CORE_PLANNER_H_
