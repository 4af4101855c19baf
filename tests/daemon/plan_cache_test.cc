// BuildStreamPlan (daemon/plan_cache.h) on registrations parsed as
// RegistryService parses them (memory not mapped): replicas that register
// the same engine tables share one resolution, each keeps its own nodes in
// the plan, an instance with other tables gets its own, and the model is
// the sources' declared parameters, sorted by name.
#include "daemon/plan_cache.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/registration_parser.h"
#include "daemon/registry.h"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

void Add(Registry& registry, absl::StatusOr<std::unique_ptr<Participant>> p) {
  INFO(p.status().ToString());
  REQUIRE(p.ok());
  absl::StatusOr<std::shared_ptr<const Participant>> added =
      registry.Add(*std::move(p), false);
  INFO(added.status().ToString());
  REQUIRE(added.ok());
}

TEST_CASE("replicas with the same engine tables share one resolution; each "
          "keeps its own nodes") {
  const MapOptions no_mapping{/*map_memory=*/false};
  Registry registry(absl::Hours(1), absl::Hours(1));
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    Add(registry, ParseSourceRegistration(trainers.back()->Registration().source(),
                                          "node-t", no_mapping));
  }
  // a and b: TP4, the same tables, on different nodes; c: TP2.
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (const auto& [instance, node, tp] :
       std::vector<std::tuple<std::string, std::string, int>>{
           {"a", "node-a", 4}, {"b", "node-b", 4}, {"c", "node-c", 2}}) {
    for (int r = 0; r < tp; ++r) {
      engines.push_back(std::make_unique<EngineRank>(instance, r, "policy"));
      engines.back()->tp_size = tp;
      Add(registry,
          ParseDestinationRegistration(
              engines.back()->Registration().destination(), node, no_mapping));
    }
  }
  absl::StatusOr<Registry::StreamSnapshot> snapshot = registry.Snapshot("policy");
  REQUIRE(snapshot.ok());
  std::shared_ptr<const StreamPlan> sp = BuildStreamPlan(*snapshot);
  REQUIRE(sp != nullptr);
  INFO(sp->source_error);
  REQUIRE(sp->source_error.empty());
  REQUIRE(sp->instances.size() == 3);
  for (const PlannedInstance& i : sp->instances) {
    INFO(i.id << ": " << i.error);
    CHECK(i.error.empty());
  }
  const PlannedInstance& a = sp->instances[sp->FindInstance("a")];
  const PlannedInstance& b = sp->instances[sp->FindInstance("b")];
  const PlannedInstance& c = sp->instances[sp->FindInstance("c")];
  CHECK(a.resolved != nullptr);
  CHECK(a.resolved == b.resolved);  // one resolution for both
  CHECK(a.layout == b.layout);
  CHECK(c.resolved != a.resolved);
  // Each instance's routes end on its own node, the shared layout's nodes
  // notwithstanding (it carries a's).
  for (const PlannedInstance* i : {&a, &b, &c}) {
    const std::string node = "node-" + i->id;
    for (const Plan* plan : {&sp->plan, &sp->direct_plan()}) {
      const InstancePlan& ip = plan->instances[i->plan_index];
      REQUIRE(!ip.routes.empty());
      for (const Route& route : ip.routes) {
        INFO(i->id << " route " << route.src_node << " -> " << route.dst_node);
        CHECK(route.dst_node == node);
      }
    }
  }
  // The model: every parameter the sources declare, sorted by name.
  REQUIRE(sp->model.params.size() == TestModel().size());
  CHECK(std::is_sorted(sp->model.params.begin(), sp->model.params.end(),
                       [](const ParamSpec& x, const ParamSpec& y) {
                         return x.name < y.name;
                       }));
}

}  // namespace
}  // namespace testing
}  // namespace ferry
