// core/cluster_model.h against cases computed by hand: one F32 [8, 4]
// tensor (128 bytes) held whole by a trainer rank on node "a"; NICs of
// 8 Gb/s (1e9 bytes/s) so that bytes read as nanoseconds; 64-byte buckets.
#include "core/cluster_model.h"

#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "core/planner.h"
#include "tests/core/one_tensor.h"

namespace ferry {
namespace {

constexpr double kNs = 1e-9;

ModelSpec Model() { return testing::OneTensorModel(); }

std::vector<RankLayout> Trainer(const std::string& node) {
  return testing::OneTensorTrainer(node);
}

// An instance of `tp` ranks, rows split evenly, ranks on `nodes`.
Instance Engine(const std::string& id, int tp, std::vector<std::string> nodes) {
  auto layout = std::make_shared<std::vector<RankLayout>>();
  for (int r = 0; r < tp; ++r) {
    RankLayout l;
    l.rank = r;
    l.node = nodes[r];
    const int64_t rows = 8 / tp;
    l.pieces.push_back(Piece::Contiguous(0, Box{{r * rows, 0}, {rows, 4}}, 0, 0,
                                         DType::kF32));
    layout->push_back(std::move(l));
  }
  Instance i;
  i.id = id;
  i.layout = layout;
  i.nodes = std::move(nodes);
  return i;
}

ClusterReport Simulate(const std::vector<RankLayout>& sources,
                    const std::vector<Instance>& instances, bool relay = true) {
  PlanOptions o;
  o.bucket_bytes = 64;
  o.relay = relay;
  absl::StatusOr<Plan> plan = PlanTransfers(Model(), sources, instances, o);
  REQUIRE(plan.ok());
  ClusterSpec c;
  c.gpus_per_node = 8;
  c.nic_gbits = 8;
  c.nvlink_gbytes = 10;
  absl::StatusOr<ClusterReport> r = ModelCluster(Model(), sources, instances, *plan, c);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return *r;
}

const GpuLoad& Gpu(const ClusterReport& r, const std::string& node, int slot) {
  for (const GpuLoad& g : r.gpus) {
    if (g.node == node && g.slot == slot) return g;
  }
  FAIL("no GPU " << node << "/" << slot);
  return r.gpus[0];
}

TEST_CASE("a TP2 instance on another node: NIC loads, bound and ratio") {
  const ClusterReport r = Simulate(Trainer("a"), {Engine("e", 2, {"b", "b"})});
  CHECK(r.cross_node_bytes == 128);
  CHECK(r.intra_node_bytes == 0);
  CHECK(Gpu(r, "a", 0).nic_out == 128);
  CHECK(Gpu(r, "b", 0).nic_in == 64);
  CHECK(Gpu(r, "b", 1).nic_in == 64);
  // The trainer's NIC is the busiest port: 128 bytes at 1 byte/ns.
  CHECK(r.busiest == "NIC out of a GPU 0 in relay stage 0");
  CHECK(r.busiest_s == Approx(128 * kNs));
  CHECK(r.pipeline_s == Approx(64 * kNs));  // one 64-byte bucket, no relay
  CHECK(r.modeled_s == Approx(192 * kNs));
  // As ferryd runs it: one route, a -> b, on one channel at one NIC's
  // rate (128 ns), the same as the busiest port here.
  CHECK(r.ferryd_s == Approx(192 * kNs));
  // Node b must take in 128 bytes over its two GPUs' NICs.
  CHECK(r.bound_node == "b");
  CHECK(r.bound_bytes == 128);
  CHECK(r.lower_bound_s == Approx(64 * kNs));
  CHECK(r.ratio == Approx(3.0));
  // Without forwarding the trainer's one NIC sends all 128 bytes.
  CHECK(r.sender_bound_nodes == std::vector<std::string>{"a"});
  CHECK(r.sender_bound_bytes == 128);
  CHECK(r.sender_bound_nics == 1);
  CHECK(r.sender_bound_s == Approx(128 * kNs));
}

TEST_CASE("a source that runs on another source's GPU shares its NIC") {
  // Two ranks on "a": rank 0 holds nothing the engine reads, rank 1 the
  // whole tensor. Placed on rank 0's GPU (as FP8 in flight's quantizer
  // ranks are on the trainer's GPUs), rank 1's bytes leave through GPU 0.
  std::vector<RankLayout> sources = Trainer("a");
  sources.push_back(sources[0]);
  sources[1].rank = 1;
  sources[0].pieces.clear();
  const std::vector<Instance> instances = {Engine("e", 2, {"b", "b"})};
  PlanOptions o;
  o.bucket_bytes = 64;
  absl::StatusOr<Plan> plan = PlanTransfers(Model(), sources, instances, o);
  REQUIRE(plan.ok());
  ClusterSpec c;
  c.nic_gbits = 8;
  const std::vector<int> gpu_of = {-1, 0};
  absl::StatusOr<ClusterReport> shared = ModelCluster(
      Model(), sources, instances, *plan, c, nullptr, nullptr, nullptr, &gpu_of);
  REQUIRE(shared.ok());
  CHECK(Gpu(*shared, "a", 0).nic_out == 128);
  for (const GpuLoad& g : shared->gpus) CHECK_FALSE((g.node == "a" && g.slot == 1));
  // Without it, rank 1 is a GPU of its own.
  absl::StatusOr<ClusterReport> own =
      ModelCluster(Model(), sources, instances, *plan, c);
  REQUIRE(own.ok());
  CHECK(Gpu(*own, "a", 1).nic_out == 128);
  CHECK(Gpu(*own, "a", 0).nic_out == 0);
}

// Rows 0-3 held by DP replicas on "a" and "c" (one group), rows 4-7 by "b"
// alone; whole-tensor instances on "x", "y" and "b". Group {a, c}: 64 bytes
// to each of the three, over 2 NICs: 96 ns. Group {b}: 64 bytes to x and
// y (b's own instance reads its rows over NVLink), over b's 2 GPUs' NICs
// (the trainer's and the engine's): 64 ns.
TEST_CASE("the sender bound: groups of trainer nodes, their NICs, local "
          "reads left out") {
  auto half = [](int32_t rank, const std::string& node, int64_t first_row) {
    RankLayout r;
    r.rank = rank;
    r.node = node;
    r.pieces.push_back(
        Piece::Contiguous(0, Box{{first_row, 0}, {4, 4}}, 0, 0, DType::kF32));
    return r;
  };
  const std::vector<RankLayout> sources = {half(0, "a", 0), half(1, "b", 4),
                                           half(2, "c", 0)};
  const ClusterReport r =
      Simulate(sources, {Engine("x", 1, {"x"}), Engine("y", 1, {"y"}),
                         Engine("b", 1, {"b"})},
               /*relay=*/false);
  CHECK(r.sender_bound_nodes == std::vector<std::string>{"a", "c"});
  CHECK(r.sender_bound_bytes == 3 * 64);
  CHECK(r.sender_bound_nics == 2);
  CHECK(r.sender_bound_s == Approx(96 * kNs));
  // Node x must take in all 128 bytes over its one NIC.
  CHECK(r.lower_bound_s == Approx(128 * kNs));

  // Given the planner's source index (as ferry_plan passes it), the same.
  const std::vector<Instance> three = {Engine("x", 1, {"x"}),
                                       Engine("y", 1, {"y"}),
                                       Engine("b", 1, {"b"})};
  PlanOptions o;
  o.bucket_bytes = 64;
  o.relay = false;
  const ModelSpec model = Model();
  auto planner = SourcePlanner::Create(model, sources, o);
  REQUIRE(planner.ok());
  absl::StatusOr<Plan> plan = (*planner)->PlanInstances(three);
  REQUIRE(plan.ok());
  ClusterSpec c;
  c.gpus_per_node = 8;
  c.nic_gbits = 8;
  absl::StatusOr<ClusterReport> indexed = ModelCluster(
      model, sources, three, *plan, c, nullptr, &(*planner)->index());
  REQUIRE(indexed.ok());
  CHECK(indexed->sender_bound_nodes == r.sender_bound_nodes);
  CHECK(indexed->sender_bound_bytes == 3 * 64);
  CHECK(indexed->sender_bound_s == Approx(96 * kNs));
}

TEST_CASE("replicas on two nodes: the relay moves the load off the trainer") {
  const std::vector<Instance> two = {Engine("r0", 1, {"b"}), Engine("r1", 1, {"c"})};
  const ClusterReport relay = Simulate(Trainer("a"), two);
  CHECK(relay.max_stage == 1);
  CHECK(Gpu(relay, "a", 0).nic_out == 128);
  CHECK(Gpu(relay, "b", 0).nic_in == 128);
  CHECK(Gpu(relay, "b", 0).nic_out == 128);  // r1 relays from r0
  CHECK(Gpu(relay, "c", 0).nic_in == 128);
  CHECK(relay.busiest_s == Approx(128 * kNs));
  // Two stages, one after the other: a -> b, then b -> c; each 128 bytes
  // plus a bucket.
  REQUIRE(relay.stage_s.size() == 2);
  CHECK(relay.stage_s[0] == Approx(192 * kNs));
  CHECK(relay.stage_s[1] == Approx(192 * kNs));
  CHECK(relay.modeled_s == Approx(384 * kNs));
  CHECK(relay.ferryd_s == Approx(384 * kNs));
  CHECK(relay.lower_bound_s == Approx(128 * kNs));  // each node: 128 bytes, 1 NIC

  const ClusterReport direct = Simulate(Trainer("a"), two, /*relay=*/false);
  CHECK(direct.max_stage == 0);
  CHECK(Gpu(direct, "a", 0).nic_out == 256);  // the trainer sends twice
  // One stage, both at once: the trainer's NIC carries 256 bytes.
  CHECK(direct.busiest_s == Approx(256 * kNs));
  CHECK(direct.modeled_s == Approx(320 * kNs));
  // ferryd runs both at once (its transfer workers): the same 320 ns.
  CHECK(direct.ferryd_s == Approx(320 * kNs));
}

TEST_CASE("as ferryd runs it: instances in waves of transfer_workers, "
          "a route striped over the rails both nodes have") {
  PlanOptions o;
  o.bucket_bytes = 64;
  o.relay = false;
  const std::vector<Instance> two = {Engine("r0", 1, {"b"}),
                                     Engine("r1", 1, {"c"})};
  absl::StatusOr<Plan> plan = PlanTransfers(Model(), Trainer("a"), two, o);
  REQUIRE(plan.ok());
  ClusterSpec c;
  c.nic_gbits = 8;
  c.nvlink_gbytes = 10;
  c.transfer_workers = 1;  // one instance at a time: 192 + 192 ns
  absl::StatusOr<ClusterReport> one =
      ModelCluster(Model(), Trainer("a"), two, *plan, c);
  REQUIRE(one.ok());
  CHECK(one->ferryd_s == Approx(384 * kNs));
  CHECK(one->modeled_s == Approx(320 * kNs));  // the plan is the same

  // Two trainer ranks on node a (two GPUs, two NICs) each send 64 bytes
  // to a TP2 instance on node b: every port carries 64 bytes (64 ns).
  // With one rail ferryd carries the pair a -> b on one channel: 128
  // bytes at one NIC; striped over both nodes' two NICs, 64 ns.
  std::vector<RankLayout> sources(2);
  for (int r = 0; r < 2; ++r) {
    sources[r].rank = r;
    sources[r].node = "a";
    sources[r].pieces.push_back(Piece::Contiguous(
        0, Box{{r * 4, 0}, {4, 4}}, 0, 0, DType::kF32));
  }
  const std::vector<Instance> tp2 = {Engine("e", 2, {"b", "b"})};
  absl::StatusOr<Plan> p2 = PlanTransfers(Model(), sources, tp2, o);
  REQUIRE(p2.ok());
  c.transfer_workers = 8;
  c.rails = 1;
  absl::StatusOr<ClusterReport> r = ModelCluster(Model(), sources, tp2, *p2, c);
  REQUIRE(r.ok());
  CHECK(r->busiest_s == Approx(64 * kNs));
  CHECK(r->modeled_s == Approx(128 * kNs));
  CHECK(r->ferryd_s == Approx(192 * kNs));
  CHECK(r->lower_bound_s == Approx(64 * kNs));
  CHECK(r->rails == 1);
  c.rails = 0;  // a rail per GPU: the two each node hosts
  r = ModelCluster(Model(), sources, tp2, *p2, c);
  REQUIRE(r.ok());
  CHECK(r->ferryd_s == Approx(128 * kNs));
  CHECK(r->rails == 8);
  // A rail count past a node's NICs is refused by ParseClusterSpec.
  CHECK(ParseClusterSpec("gpus_per_node=8,rails=8").ok());
  CHECK(ParseClusterSpec("gpus_per_node=8,rails=4")->rails == 4);
  CHECK(absl::IsInvalidArgument(
      ParseClusterSpec("gpus_per_node=4,rails=8").status()));
  CHECK(absl::IsInvalidArgument(ParseClusterSpec("rails=1.5").status()));
}

TEST_CASE("as ferryd runs relays: not for an instance spread over nodes") {
  // TP2 replicas, each over two nodes: the plan relays r1 from r0, but
  // ferryd relays only between instances that each sit on one node, so r1
  // reads the trainer, at the same time as r0.
  const std::vector<Instance> spread = {Engine("r0", 2, {"b", "c"}),
                                        Engine("r1", 2, {"d", "e"})};
  PlanOptions o;
  o.bucket_bytes = 64;
  absl::StatusOr<Plan> relay = PlanTransfers(Model(), Trainer("a"), spread, o);
  o.relay = false;
  absl::StatusOr<Plan> direct = PlanTransfers(Model(), Trainer("a"), spread, o);
  REQUIRE(relay.ok());
  REQUIRE(direct.ok());
  REQUIRE(relay->instances[1].relay_from == 0);
  ClusterSpec c;
  c.nic_gbits = 8;
  absl::StatusOr<ClusterReport> r =
      ModelCluster(Model(), Trainer("a"), spread, *relay, c, &*direct);
  REQUIRE(r.ok());
  CHECK(r->max_stage == 0);
  CHECK(Gpu(*r, "a", 0).nic_out == 256);
  CHECK(Gpu(*r, "b", 0).nic_out == 0);  // r0 relays nothing
  CHECK(Gpu(*r, "d", 0).nic_in == 64);
  CHECK(r->modeled_s == Approx((256 + 64) * kNs));
  // Without the relay-free plan the model runs the plan's relay.
  absl::StatusOr<ClusterReport> as_planned =
      ModelCluster(Model(), Trainer("a"), spread, *relay, c);
  REQUIRE(as_planned.ok());
  CHECK(as_planned->max_stage == 1);
  CHECK(Gpu(*as_planned, "b", 0).nic_out == 64);
}

TEST_CASE("as ferryd runs relays: between nodes only where the tree pays") {
  // Four TP1 replicas, one node each (a binary tree: r0 <- sources; r1, r2
  // <- r0; r3 <- r1: 1 + 2 + 1 = 4 models one after another on the
  // busiest nodes). Fed by one trainer node the relay pays (4 x 1 <= 4);
  // fed by four trainer ranks on four nodes it does not (4 x 4 > 4), and
  // every replica reads the trainers at once (core/relay_choice.h).
  const std::vector<Instance> four = {
      Engine("r0", 1, {"b"}), Engine("r1", 1, {"c"}), Engine("r2", 1, {"d"}),
      Engine("r3", 1, {"e"})};
  std::vector<RankLayout> spread;  // four trainer ranks, a quarter each
  for (int r = 0; r < 4; ++r) {
    RankLayout l;
    l.rank = r;
    l.node = std::string(1, static_cast<char>('s' + r));
    l.pieces.push_back(
        Piece::Contiguous(0, Box{{2 * r, 0}, {2, 4}}, 0, 0, DType::kF32));
    spread.push_back(std::move(l));
  }
  ClusterSpec c;
  c.nic_gbits = 8;
  for (const bool many : {false, true}) {
    INFO((many ? "four trainer nodes" : "one trainer node"));
    const std::vector<RankLayout> sources = many ? spread : Trainer("a");
    PlanOptions o;
    o.bucket_bytes = 64;
    absl::StatusOr<Plan> relay = PlanTransfers(Model(), sources, four, o);
    o.relay = false;
    absl::StatusOr<Plan> direct = PlanTransfers(Model(), sources, four, o);
    REQUIRE(relay.ok());
    REQUIRE(direct.ok());
    REQUIRE(relay->instances[3].relay_from == 1);
    absl::StatusOr<ClusterReport> r =
        ModelCluster(Model(), sources, four, *relay, c, &*direct);
    REQUIRE(r.ok());
    if (many) {
      CHECK(r->max_stage == 0);
      CHECK(Gpu(*r, "b", 0).nic_out == 0);  // nobody relays
      CHECK(Gpu(*r, "s", 0).nic_out == 4 * 32);  // its quarter, four times
      CHECK(r->modeled_s == Approx((128 + 64) * kNs));
    } else {
      CHECK(r->max_stage == 2);
      CHECK(Gpu(*r, "a", 0).nic_out == 128);  // once
      CHECK(Gpu(*r, "b", 0).nic_out == 256);  // r0 feeds r1 and r2
    }
  }
}

TEST_CASE("on one node: NVLink carries it, and the bound is zero") {
  const ClusterReport r = Simulate(Trainer("a"), {Engine("e", 2, {"a", "a"})});
  CHECK(r.cross_node_bytes == 0);
  CHECK(r.intra_node_bytes == 128);
  CHECK(Gpu(r, "a", 0).nvlink_out == 128);  // the trainer's GPU
  CHECK(Gpu(r, "a", 1).nvlink_in == 64);    // the engine's ranks: GPUs 1, 2
  CHECK(Gpu(r, "a", 2).nvlink_in == 64);
  CHECK(r.busiest == "NVLink out of a GPU 0 in relay stage 0");
  CHECK(r.busiest_s == Approx(128 / 10e9));
  CHECK(r.lower_bound_s == 0);  // node a holds every byte it needs
  CHECK(r.ratio == 0);
}

TEST_CASE("more ranks on a node than it has GPUs is refused") {
  PlanOptions o;
  const std::vector<Instance> inst = {Engine("e", 2, {"b", "b"})};
  absl::StatusOr<Plan> plan = PlanTransfers(Model(), Trainer("a"), inst, o);
  REQUIRE(plan.ok());
  ClusterSpec c;
  c.gpus_per_node = 1;
  CHECK_FALSE(ModelCluster(Model(), Trainer("a"), inst, *plan, c).ok());
  CHECK_FALSE(ParseClusterSpec("nic_gbits=fast").ok());
  CHECK_FALSE(ParseClusterSpec("pcie=5").ok());
  CHECK_FALSE(ParseClusterSpec("gpus_per_node=8.5").ok());
  absl::StatusOr<ClusterSpec> s = ParseClusterSpec("gpus_per_node=4,nic_gbits=200");
  REQUIRE(s.ok());
  CHECK(s->gpus_per_node == 4);
  CHECK(s->nic_gbits == 200);
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

TEST_CASE("delta versions on a cluster: bytes between nodes are patches") {
  CHECK(PatchFraction(-1) == 1.0);
  CHECK(PatchFraction(0) == 0.0);
  CHECK(PatchFraction(0.01) == Approx(0.03));     // changes + 4-byte indices
  CHECK(PatchFraction(0.05) == Approx(0.1125));   // changes + a bitmap
  CHECK(PatchFraction(0.5) == Approx(0.5625));
  CHECK(PatchFraction(1.0) == 1.0);               // dense
  PlanOptions o;
  o.bucket_bytes = 64;
  const std::vector<Instance> one = {Engine("e", 2, {"b", "b"})};
  absl::StatusOr<Plan> plan = PlanTransfers(Model(), Trainer("a"), one, o);
  REQUIRE(plan.ok());
  ClusterSpec c;
  c.gpus_per_node = 8;
  c.nic_gbits = 8;
  c.nvlink_gbytes = 10;
  absl::StatusOr<ClusterReport> dense =
      ModelCluster(Model(), Trainer("a"), one, *plan, c);
  c.delta_density = 0.05;
  absl::StatusOr<ClusterReport> delta =
      ModelCluster(Model(), Trainer("a"), one, *plan, c);
  REQUIRE(dense.ok());
  REQUIRE(delta.ok());
  CHECK(dense->cross_node_bytes == 128);
  CHECK(delta->cross_node_bytes == 14);  // two copies of 64 -> 7 each
  CHECK(delta->lower_bound_s == Approx(dense->lower_bound_s * 0.1125));
  CHECK(delta->ferryd_s < dense->ferryd_s);
  CHECK_THAT(delta->assumptions.back(),
             Catch::Contains("delta versions: 5.00% of the elements change"));
}

}  // namespace
}  // namespace ferry
