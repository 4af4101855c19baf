// core/relay_choice.h: the relay trees of real plans (the planner's binary
// tree over replicas) and the rule, against cases counted by hand.
#include "core/relay_choice.h"

#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "core/planner.h"

namespace ferry {
namespace {

// `n` TP1 replicas of one F32 [8, 4] tensor, fed by one trainer rank.
Plan Replicas(int n) {
  ModelSpec m;
  m.params.push_back(ParamSpec{"w", DType::kF32, {8, 4}});
  m.BuildIndex();
  RankLayout t;
  t.pieces.push_back(Piece::Contiguous(0, Box{{0, 0}, {8, 4}}, 0, 0, DType::kF32));
  std::vector<Instance> instances;
  for (int i = 0; i < n; ++i) {
    auto layout = std::make_shared<std::vector<RankLayout>>(1, t);
    Instance in;
    in.id = "r" + std::to_string(i);
    in.layout = layout;
    in.nodes = {"n" + std::to_string(i)};
    instances.push_back(std::move(in));
  }
  absl::StatusOr<Plan> plan = PlanTransfers(m, {t}, instances, PlanOptions());
  REQUIRE(plan.ok());
  return *std::move(plan);
}

TEST_CASE("relay trees of the planner's binary tree") {
  // n: replicas, stages, models the busiest nodes move one after another.
  struct Case {
    int n, stages, serial;
  };
  for (const Case c : {Case{1, 1, 1}, Case{2, 2, 2}, Case{3, 2, 3},
                       Case{4, 3, 4}, Case{8, 4, 6}}) {
    INFO(c.n << " replicas");
    const std::vector<RelayTree> trees = RelayTrees(Replicas(c.n));
    REQUIRE(trees.size() == static_cast<size_t>(c.n));
    for (const RelayTree& t : trees) {
      CHECK(t.replicas == c.n);
      CHECK(t.stages == c.stages);
      CHECK(t.serial_models == c.serial);
    }
  }
}

TEST_CASE("a relay between nodes pays when the sources' nodes are few") {
  const RelayTree two{2, 2, 2}, four{4, 3, 4}, eight{8, 4, 6};
  CHECK(CrossNodeRelayPays(1, two));       // 2 <= 2: a tie keeps the relay
  CHECK_FALSE(CrossNodeRelayPays(2, two));
  CHECK(CrossNodeRelayPays(1, four));
  CHECK_FALSE(CrossNodeRelayPays(4, four));  // Qwen3-235B on 64 GPUs
  CHECK(CrossNodeRelayPays(1, eight));       // 6 <= 8
  CHECK_FALSE(CrossNodeRelayPays(2, eight));
  CHECK(CrossNodeRelayPays(0, two));  // no source node known: as one
}

}  // namespace
}  // namespace ferry
