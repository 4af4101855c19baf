// core/exchange.h against a case computed by hand: one F32 [8, 4] tensor
// (128 bytes) held whole by one trainer rank on node "a", two TP1
// replicas on nodes "b" and "c", 32-byte buckets (four of two rows each).
// Without exchange the trainer rank sends 256 bytes, each replica takes
// 128. Exchanged, each replica reads two buckets from the trainer and is
// given the other two by its partner: 128 + 64 + one bucket = 224 < 256.
#include "core/exchange.h"

#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "core/cluster_model.h"
#include "core/planner.h"
#include "tests/core/one_tensor.h"

namespace ferry {
namespace {

ModelSpec Model() { return testing::OneTensorModel(); }

std::vector<RankLayout> Trainer(const std::string& node) {
  return testing::OneTensorTrainer(node);
}

Instance Replica(const std::string& id, const std::string& node,
                 uint32_t buffer = 0) {
  auto layout = std::make_shared<std::vector<RankLayout>>();
  RankLayout l;
  l.node = node;
  l.pieces.push_back(
      Piece::Contiguous(0, Box{{0, 0}, {8, 4}}, buffer, 0, DType::kF32));
  layout->push_back(std::move(l));
  Instance i;
  i.id = id;
  i.layout = layout;
  i.nodes = {node};
  return i;
}

struct Planned {
  Plan plan;
  std::vector<Exchange> exchanges;
};

Planned Choose(const std::vector<RankLayout>& sources,
               const std::vector<Instance>& instances) {
  PlanOptions o;
  o.bucket_bytes = 32;
  o.relay = false;  // every replica reads the sources
  absl::StatusOr<Plan> plan = PlanTransfers(Model(), sources, instances, o);
  REQUIRE(plan.ok());
  std::vector<const InstancePlan*> reads;
  for (const InstancePlan& ip : plan->instances) reads.push_back(&ip);
  Planned out;
  out.exchanges = ChooseExchanges(sources, instances, reads, 32);
  out.plan = *std::move(plan);
  REQUIRE(out.exchanges.size() == instances.size());
  return out;
}

TEST_CASE("two replicas fed by one trainer rank split its buckets") {
  const std::vector<RankLayout> sources = Trainer("a");
  const std::vector<Instance> instances = {Replica("e0", "b"),
                                           Replica("e1", "c")};
  const Planned p = Choose(sources, instances);
  // They read alike: one shared list of four 32-byte buckets.
  REQUIRE(p.plan.instances[0].copies.SharesWith(p.plan.instances[1].copies));
  REQUIRE(p.plan.instances[0].buckets.size() == 4);
  const Exchange& e0 = p.exchanges[0];
  const Exchange& e1 = p.exchanges[1];
  CHECK(e0.partner == 1);
  CHECK(e1.partner == 0);
  // Largest first, ties in bucket order, each to the side whose second
  // part is lighter (e0 at a tie): 0 -> e0, 1 -> e1, 2 -> e0, 3 -> e1.
  CHECK(e0.buckets == std::vector<int32_t>{0, 2});
  CHECK(e1.buckets == std::vector<int32_t>{1, 3});
  CHECK(e0.bytes == 64);
  CHECK(e1.bytes == 64);
  CHECK(e0.given(2));
  CHECK_FALSE(e0.given(1));

  // The cluster model runs it as ferryd does. NICs of 8 Gb/s: bytes read
  // as nanoseconds. First part: the trainer's GPU sends 2 x 64; then each
  // replica's GPU sends 64 to the other and takes 64 in; a 32-byte bucket
  // fills each stage's pipe.
  ClusterSpec c;
  c.nic_gbits = 8;
  absl::StatusOr<ClusterReport> with =
      ModelCluster(Model(), sources, instances, p.plan, c, nullptr, nullptr,
                   &p.exchanges);
  REQUIRE(with.ok());
  CHECK(with->exchanged_bytes == 128);
  CHECK(with->cross_node_bytes == 256);
  REQUIRE(with->stage_s.size() == 2);
  CHECK(with->stage_s[0] == Approx(160e-9));
  CHECK(with->stage_s[1] == Approx(96e-9));
  CHECK(with->modeled_s == Approx(256e-9));
  // As ferryd runs it: each part's routes (one per pair of nodes) at one
  // NIC's rate; here no route is slower than the busiest port, so the
  // same.
  CHECK(with->ferryd_s == Approx(256e-9));
  for (const GpuLoad& g : with->gpus) {
    INFO(g.node);
    if (g.node == "a") CHECK(g.nic_out == 128);
    if (g.node == "b" || g.node == "c") {
      CHECK(g.nic_in == 128);
      CHECK(g.nic_out == 64);
    }
  }
  absl::StatusOr<ClusterReport> without =
      ModelCluster(Model(), sources, instances, p.plan, c);
  REQUIRE(without.ok());
  CHECK(without->modeled_s == Approx(288e-9));  // 256 + one bucket
  CHECK(without->exchanged_bytes == 0);
}

TEST_CASE("nothing is exchanged where it cannot pay or must not be") {
  const std::vector<RankLayout> sources = Trainer("a");
  auto none = [](const Planned& p) {
    for (const Exchange& e : p.exchanges) {
      if (e.partner >= 0 || !e.buckets.empty()) return false;
    }
    return true;
  };
  SECTION("one replica: no partner") {
    CHECK(none(Choose(sources, {Replica("e0", "b")})));
  }
  SECTION("a replica that may not serve as a peer") {
    Instance shy = Replica("e1", "c");
    shy.may_relay = false;
    CHECK(none(Choose(sources, {Replica("e0", "b"), shy})));
  }
  SECTION("replicas on the trainer's node") {
    CHECK(none(Choose(sources, {Replica("e0", "a"), Replica("e1", "a")})));
  }
  SECTION("replicas that share a node") {
    CHECK(none(Choose(sources, {Replica("e0", "b"), Replica("e1", "b")})));
  }
  SECTION("buckets into a fallback tensor's staging") {
    CHECK(none(Choose(sources, {Replica("e0", "b", kStagingBufferBit),
                                Replica("e1", "c", kStagingBufferBit)})));
  }
  SECTION("receivers busier than the trainer: four ranks on four nodes") {
    // Each trainer rank sends its 32 bytes twice (64); each replica takes
    // 128 in.
    std::vector<RankLayout> tp4;
    for (int r = 0; r < 4; ++r) {
      RankLayout l;
      l.rank = r;
      l.node = "t" + std::to_string(r);
      l.pieces.push_back(Piece::Contiguous(0, Box{{2 * r, 0}, {2, 4}}, 0, 0,
                                           DType::kF32));
      tp4.push_back(std::move(l));
    }
    CHECK(none(Choose(tp4, {Replica("e0", "b"), Replica("e1", "c")})));
  }
  SECTION("relayed replicas (null plans) take no part") {
    PlanOptions o;
    o.bucket_bytes = 32;
    o.relay = false;
    const std::vector<Instance> instances = {Replica("e0", "b"),
                                            Replica("e1", "c")};
    absl::StatusOr<Plan> plan = PlanTransfers(Model(), sources, instances, o);
    REQUIRE(plan.ok());
    const std::vector<Exchange> e = ChooseExchanges(
        sources, instances, {&plan->instances[0], nullptr}, 32);
    CHECK(e[0].partner == -1);
    CHECK(e[1].partner == -1);
  }
}

}  // namespace
}  // namespace ferry
