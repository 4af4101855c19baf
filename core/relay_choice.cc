#include "core/relay_choice.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <set>
#include <string>

namespace ferry {

std::vector<RelayTree> RelayTrees(const Plan& plan) {
  const size_t n = plan.instances.size();
  std::vector<int32_t> root(n), children(n, 0);
  for (size_t k = 0; k < n; ++k) {
    root[k] = RelayRoot(plan, static_cast<int32_t>(k));
    if (plan.instances[k].relay_from >= 0) {
      ++children[plan.instances[k].relay_from];
    }
  }
  // Per tree: replicas, and per stage s >= 1 the most children a parent of
  // stage s - 1 has.
  std::map<int32_t, RelayTree> trees;
  std::map<int32_t, std::map<int, int>> fan_out;  // root -> stage -> max
  for (size_t k = 0; k < n; ++k) {
    auto [it, fresh] = trees.try_emplace(root[k]);
    if (!fresh) ++it->second.replicas;
    const int stage = plan.instances[k].stage;
    it->second.stages = std::max(it->second.stages, stage + 1);
    if (children[k] > 0) {
      int& most = fan_out[root[k]][stage + 1];
      most = std::max(most, children[k]);
    }
  }
  for (auto& [r, tree] : trees) {
    tree.serial_models = 1;
    for (const auto& [stage, most] : fan_out[r]) tree.serial_models += most;
  }
  std::vector<RelayTree> out(n);
  for (size_t k = 0; k < n; ++k) out[k] = trees[root[k]];
  return out;
}

bool CrossNodeRelayPays(int source_nodes, const RelayTree& tree) {
  return static_cast<int64_t>(tree.serial_models) * std::max(source_nodes, 1) <=
         tree.replicas;
}

RelayWhere WhereRelayRuns(const Plan& plan,
                          const std::vector<Instance>& instances, int32_t k,
                          const std::vector<RelayTree>& trees,
                          int source_nodes) {
  const int32_t from = plan.instances[k].relay_from;
  if (from < 0) return RelayWhere::kNever;
  auto on_one_node = [&](int32_t i) {
    for (size_t r = 0; r < instances[i].layout->size(); ++r) {
      if (instances[i].node(r) != instances[i].node(0)) return false;
    }
    return true;
  };
  if (!on_one_node(k) || !on_one_node(from)) return RelayWhere::kNever;
  const bool same_node = instances[k].node(0) == instances[from].node(0);
  if (!same_node && !CrossNodeRelayPays(source_nodes, trees[k])) {
    return RelayWhere::kNever;
  }
  if (!HasStagingPieces(*instances[k].layout)) return RelayWhere::kAlways;
  return same_node ? RelayWhere::kCoordinatorsNode : RelayWhere::kNever;
}

int SourceNodes(const std::vector<RankLayout>& sources) {
  std::set<std::string> nodes;
  for (const RankLayout& s : sources) nodes.insert(s.node);
  return static_cast<int>(nodes.size());
}

}  // namespace ferry
