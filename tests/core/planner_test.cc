// Planner behaviour a user relies on: TP-matched layouts are rank-to-rank
// copies, replicas share the load and stay on-node, replicas of an instance
// relay, buckets respect the staging size, and plans are deterministic.
#include <catch2/catch.hpp>

#include <chrono>
#include <map>
#include <set>

#include "absl/strings/str_cat.h"
#include "core/parallel_for.h"
#include "core/planner.h"
#include "core/region_copy.h"

namespace ferry {
namespace {

ModelSpec TwoParams() {
  ModelSpec m;
  m.params.push_back({"w.col", DType::kBF16, {64, 32}});
  m.params.push_back({"w.row", DType::kBF16, {32, 64}});
  m.BuildIndex();
  return m;
}

// TP-sharded layout: "w.col" split on dim 0, "w.row" on dim 1, `dp`
// replicas of it, ranks on nodes of `per_node` ranks named `prefix`N.
std::vector<RankLayout> Sharded(const ModelSpec& m, int tp, int dp,
                                const std::string& prefix, int per_node) {
  std::vector<RankLayout> ranks;
  for (int rep = 0; rep < dp; ++rep) {
    for (int t = 0; t < tp; ++t) {
      RankLayout r;
      r.rank = rep * tp + t;
      r.node = absl::StrCat(prefix, r.rank / per_node);
      Box col{{64 / tp * t, 0}, {64 / tp, 32}};
      Box row{{0, 64 / tp * t}, {32, 64 / tp}};
      r.pieces.push_back(Piece::Contiguous(0, col, 0, 0, DType::kBF16));
      r.pieces.push_back(
          Piece::Contiguous(1, row, 0, BoxBytes(col, DType::kBF16), DType::kBF16));
      ranks.push_back(std::move(r));
    }
  }
  return ranks;
}

Instance MakeInstance(const std::string& id, std::vector<RankLayout> ranks) {
  Instance i;
  i.id = id;
  i.layout = std::make_shared<std::vector<RankLayout>>(std::move(ranks));
  return i;
}

TEST_CASE("TP-matched layouts are whole-piece rank-to-rank copies") {
  const ModelSpec m = TwoParams();
  const auto sources = Sharded(m, 4, 1, "n", 8);
  const Instance inst = MakeInstance("r0", Sharded(m, 4, 1, "n", 8));
  auto plan = PlanTransfers(m, sources, {inst});
  REQUIRE(plan.ok());
  const InstancePlan& ip = plan->instances[0];
  REQUIRE(ip.copies.size() == 8);
  for (const Copy& c : ip.copies) {
    CHECK(c.src_rank == c.dst_rank);  // rank r feeds rank r: no gather
    CHECK(c.box == Copy::kWholePiece);
    CHECK(ip.BoxOf(c, *inst.layout) ==
          sources[c.src_rank].pieces[c.src_piece].box);  // whole piece
  }
}

TEST_CASE("Resharding TP4 to TP2 gathers each rank from two sources") {
  const ModelSpec m = TwoParams();
  auto plan = PlanTransfers(m, Sharded(m, 4, 1, "n", 8),
                            {MakeInstance("r0", Sharded(m, 2, 1, "n", 8))});
  REQUIRE(plan.ok());
  std::map<int, std::set<int>> from;
  for (const Copy& c : plan->instances[0].copies) from[c.dst_rank].insert(c.src_rank);
  CHECK(from[0] == std::set<int>{0, 1});
  CHECK(from[1] == std::set<int>{2, 3});
}

TEST_CASE("Replicas share the load and sources on the destination's node win") {
  const ModelSpec m = TwoParams();
  // TP1 x DP4: every trainer rank holds everything; ranks 0-1 on node a0,
  // ranks 2-3 on node a1.
  const auto sources = Sharded(m, 1, 4, "a", 2);
  SECTION("balanced over replicas when no replica is local") {
    auto plan = PlanTransfers(m, sources, {MakeInstance("r0", Sharded(m, 4, 1, "b", 8))});
    REQUIRE(plan.ok());
    for (int64_t bytes : plan->bytes_per_source_rank) {
      CHECK(bytes == plan->source_bytes / 4);
    }
  }
  SECTION("a destination on node a1 reads only from ranks 2-3") {
    auto plan = PlanTransfers(m, sources, {MakeInstance("r0", Sharded(m, 4, 1, "a1-", 8))});
    REQUIRE(plan.ok());
    auto dst = Sharded(m, 4, 1, "x", 8);
    for (auto& r : dst) r.node = "a1";
    plan = PlanTransfers(m, sources, {MakeInstance("r0", dst)});
    REQUIRE(plan.ok());
    for (const Copy& c : plan->instances[0].copies) {
      CHECK(sources[c.src_rank].node == "a1");
    }
    CHECK(plan->bytes_per_source_rank[0] == 0);
    CHECK(plan->bytes_per_source_rank[2] == plan->bytes_per_source_rank[3]);
  }
}

TEST_CASE("A shard with several holders goes to the one with less to send "
          "in all, counting the shards only it holds") {
  const ModelSpec m = TwoParams();
  const Box col{{0, 0}, {64, 32}};  // w.col whole
  const Box row{{0, 0}, {32, 64}};  // w.row whole
  const int64_t col_bytes = BoxBytes(col, DType::kBF16);
  const int64_t row_bytes = BoxBytes(row, DType::kBF16);
  // Rank 0 alone holds w.col; ranks 0 and 1 both hold w.row.
  std::vector<RankLayout> sources(2);
  for (int r = 0; r < 2; ++r) {
    sources[r].rank = r;
    sources[r].node = "t";
  }
  sources[0].pieces.push_back(Piece::Contiguous(0, col, 0, 0, DType::kBF16));
  sources[0].pieces.push_back(
      Piece::Contiguous(1, row, 0, col_bytes, DType::kBF16));
  sources[1].pieces.push_back(Piece::Contiguous(1, row, 0, 0, DType::kBF16));
  // The destination lists w.row first: by the bytes chosen so far alone,
  // the two holders would tie at w.row and rank 0 would send everything.
  RankLayout dst;
  dst.rank = 0;
  dst.node = "i";
  dst.pieces.push_back(Piece::Contiguous(1, row, 0, 0, DType::kBF16));
  dst.pieces.push_back(
      Piece::Contiguous(0, col, 0, row_bytes, DType::kBF16));
  auto plan = PlanTransfers(m, sources, {MakeInstance("r0", {dst})});
  REQUIRE(plan.ok());
  CHECK(plan->bytes_per_source_rank[0] == col_bytes);
  CHECK(plan->bytes_per_source_rank[1] == row_bytes);
}

// Two DP replicas on two nodes each hold parameters of 1, 1 and 2 units,
// which the destination lists in that order. Chosen in that order, the
// holders tie at the 2-unit one (1 + 1 each side) and the first takes it:
// 3 against 1. Largest first: the 2-unit one to one holder, both 1-unit
// ones to the other: 2 against 2.
TEST_CASE("Shards with several holders are chosen largest first") {
  ModelSpec m;
  m.params.push_back({"a", DType::kBF16, {16, 16}});
  m.params.push_back({"b", DType::kBF16, {16, 16}});
  m.params.push_back({"c", DType::kBF16, {32, 16}});
  m.BuildIndex();
  // One rank holding the parameters whole, back to back in `order`.
  auto whole = [&m](const std::vector<int32_t>& order) {
    RankLayout r;
    int64_t at = 0;
    for (int32_t p : order) {
      const Box box = FullBox(m.params[p].shape);
      r.pieces.push_back(Piece::Contiguous(p, box, 0, at, DType::kBF16));
      at += BoxBytes(box, DType::kBF16);
    }
    return r;
  };
  std::vector<RankLayout> sources = {whole({0, 1, 2}), whole({0, 1, 2})};
  for (int r = 0; r < 2; ++r) {
    sources[r].rank = r;
    sources[r].node = absl::StrCat("t", r);
  }
  RankLayout dst = whole({0, 1, 2});
  dst.rank = 0;
  dst.node = "i";
  auto plan = PlanTransfers(m, sources, {MakeInstance("r0", {dst})});
  REQUIRE(plan.ok());
  const int64_t unit = BoxBytes(FullBox(m.params[0].shape), DType::kBF16);
  CHECK(plan->bytes_per_source_rank[0] == 2 * unit);
  CHECK(plan->bytes_per_source_rank[1] == 2 * unit);
}

TEST_CASE("Replicas of one layout relay in a binary tree") {
  const ModelSpec m = TwoParams();
  const auto layout = std::make_shared<std::vector<RankLayout>>(Sharded(m, 2, 1, "i", 8));
  std::vector<Instance> instances;
  for (int k = 0; k < 7; ++k) {
    Instance inst;
    inst.id = absl::StrCat("r", k);
    inst.layout = layout;
    inst.nodes = {absl::StrCat("i", k), absl::StrCat("i", k)};
    instances.push_back(inst);
  }
  PlanOptions relay;
  auto plan = PlanTransfers(m, Sharded(m, 4, 1, "t", 8), instances, relay);
  REQUIRE(plan.ok());
  const int64_t model_bytes = (64 * 32 + 32 * 64) * 2;
  CHECK(plan->source_bytes == model_bytes);  // the trainer sends it once
  CHECK(plan->instances[0].relay_from == -1);
  std::map<int, int> children;
  for (int k = 1; k < 7; ++k) {
    const InstancePlan& ip = plan->instances[k];
    CHECK(ip.relay_from == (k - 1) / 2);
    CHECK(ip.copies.empty());
    CHECK(ip.bytes == model_bytes);
    children[ip.relay_from]++;
  }
  for (const auto& [parent, n] : children) CHECK(n <= 2);
  CHECK(plan->instances[6].stage == 2);

  PlanOptions direct;
  direct.relay = false;
  auto flat = PlanTransfers(m, Sharded(m, 4, 1, "t", 8), instances, direct);
  REQUIRE(flat.ok());
  CHECK(flat->source_bytes == 7 * model_bytes);
}

TEST_CASE("Replicas that read alike share one copy list; a replica beside "
          "the sources reads its own") {
  const ModelSpec m = TwoParams();
  // TP2 x DP2 trainer: ranks 0-1 on t0, 2-3 on t1.
  const auto sources = Sharded(m, 2, 2, "t", 2);
  const auto layout =
      std::make_shared<std::vector<RankLayout>>(Sharded(m, 4, 1, "x", 8));
  auto replica = [&](const std::string& id, std::vector<std::string> nodes) {
    Instance inst;
    inst.id = id;
    inst.layout = layout;
    inst.nodes = std::move(nodes);
    return inst;
  };
  // r0, r1: two ranks a node, on nodes without sources; r2: the same
  // layout with ranks 0-1 beside trainer ranks 2-3.
  const std::vector<Instance> instances = {
      replica("r0", {"i0", "i0", "i1", "i1"}),
      replica("r1", {"i2", "i2", "i3", "i3"}),
      replica("r2", {"t1", "t1", "i4", "i4"})};
  absl::StatusOr<std::unique_ptr<const SourcePlanner>> planner =
      SourcePlanner::Create(m, sources);
  REQUIRE(planner.ok());
  CHECK((*planner)->ReadAlike(instances[0], instances[1]));
  CHECK(!(*planner)->ReadAlike(instances[0], instances[2]));
  // Ranks that share a node in one replica and not in the other do not
  // read alike (their routes group differently).
  CHECK(!(*planner)->ReadAlike(instances[0],
                               replica("r3", {"i5", "i6", "i7", "i8"})));

  PlanOptions direct;
  direct.relay = false;
  absl::StatusOr<Plan> plan = (*planner)->PlanInstances(instances);
  REQUIRE(plan.ok());
  const InstancePlan& r0 = plan->instances[0];
  const InstancePlan& r1 = plan->instances[1];
  const InstancePlan& r2 = plan->instances[2];
  REQUIRE(r0.relay_from == -1);
  REQUIRE(r1.relay_from == 0);  // relays: nothing from the sources
  REQUIRE(r2.relay_from == 0);
  absl::StatusOr<Plan> flat = PlanTransfers(m, sources, instances, direct);
  REQUIRE(flat.ok());
  const InstancePlan& f0 = flat->instances[0];
  const InstancePlan& f1 = flat->instances[1];
  const InstancePlan& f2 = flat->instances[2];
  CHECK(f1.copies.SharesWith(f0.copies));
  CHECK(f1.buckets.SharesWith(f0.buckets));
  CHECK(!f2.copies.SharesWith(f0.copies));
  // Its own routes: the same source nodes, its own destination nodes.
  REQUIRE(f1.routes.size() == f0.routes.size());
  for (size_t k = 0; k < f0.routes.size(); ++k) {
    CHECK(f1.routes[k].src_node == f0.routes[k].src_node);
    CHECK(f1.routes[k].bytes == f0.routes[k].bytes);
    CHECK(f1.routes[k].dst_node ==
          (f0.routes[k].dst_node == "i0" ? "i2" : "i3"));
  }
  // r2's ranks 0-1 read only trainer ranks 2-3, beside them on t1.
  for (const Copy& c : f2.copies) {
    if (c.dst_rank < 2) CHECK(sources[c.src_rank].node == "t1");
  }
  // r0 as the relay plan has it, r1 from r0's copies, and each planned
  // alone: all the same as without relays.
  Plan a, b;
  a.instances = {f0, f1, f2};
  b.instances = {r0, (*planner)->PlanAlike(r0, instances[1]),
                 (*planner)->PlanAlone(instances[2])};
  CHECK(PlanDigest(a) == PlanDigest(b));
  for (size_t k = 0; k < 3; ++k) {
    Plan x, y;
    x.instances = {a.instances[k]};
    y.instances = {(*planner)->PlanAlone(instances[k])};
    INFO("instance " << k);
    CHECK(PlanDigest(x) == PlanDigest(y));
  }
}

TEST_CASE("An instance that may not relay is never a relay source") {
  const ModelSpec m = TwoParams();
  const auto layout = std::make_shared<std::vector<RankLayout>>(Sharded(m, 2, 1, "i", 8));
  std::vector<Instance> instances;
  for (int k = 0; k < 7; ++k) {
    Instance inst;
    inst.id = absl::StrCat("r", k);
    inst.layout = layout;
    inst.nodes = {absl::StrCat("i", k), absl::StrCat("i", k)};
    inst.may_relay = k != 1;  // r1 (parent of r3, r4) keeps to itself
    instances.push_back(inst);
  }
  auto plan = PlanTransfers(m, Sharded(m, 4, 1, "t", 8), instances);
  REQUIRE(plan.ok());
  for (const InstancePlan& ip : plan->instances) CHECK(ip.relay_from != 1);
  CHECK(plan->instances[1].relay_from == 0);  // it may still receive one
  CHECK(plan->instances[3].relay_from == 0);  // r1's children go up
  CHECK(plan->instances[4].relay_from == 0);
  CHECK(plan->instances[5].relay_from == 2);

  instances[0].may_relay = false;  // no relaying ancestor: the sources
  plan = PlanTransfers(m, Sharded(m, 4, 1, "t", 8), instances);
  REQUIRE(plan.ok());
  CHECK(plan->instances[1].relay_from == -1);
  CHECK(plan->instances[3].relay_from == -1);
  CHECK(plan->instances[5].relay_from == 2);
}

TEST_CASE("Copies larger than a bucket are split; buckets hold one channel") {
  ModelSpec m;
  m.params.push_back({"big", DType::kF32, {100, 300}});
  m.params.push_back({"q", DType::kQ4_K, {8, 1024}});
  m.BuildIndex();
  std::vector<RankLayout> src(1);
  src[0].node = "a";
  src[0].pieces.push_back(Piece::Contiguous(0, FullBox({100, 300}), 0, 0, DType::kF32));
  src[0].pieces.push_back(Piece::Contiguous(1, FullBox({8, 1024}), 0, 120000, DType::kQ4_K));
  std::vector<RankLayout> dst = src;
  dst[0].node = "b";
  PlanOptions opt;
  opt.bucket_bytes = 1000;  // 300 floats = 1200 bytes: even a row is split
  auto plan = PlanTransfers(m, src, {MakeInstance("r0", dst)}, opt);
  REQUIRE(plan.ok());
  int64_t total = 0;
  for (const Copy& c : plan->instances[0].copies) {
    CHECK(c.bytes <= 1000);
    const Box& box = plan->instances[0].BoxOf(c, dst);
    CHECK(BoxBytes(box, c.param == 0 ? DType::kF32 : DType::kQ4_K) == c.bytes);
    if (c.param == 1) {  // whole 256-element blocks only
      CHECK(box.offset[1] % 256 == 0);
      CHECK(box.extent[1] % 256 == 0);
    }
    total += c.bytes;
  }
  CHECK(total == 100 * 300 * 4 + 8 * 4 * 144);
  for (const Bucket& b : plan->instances[0].buckets) CHECK(b.bytes <= 1000);
  CHECK(plan->instances[0].routes.size() == 1);
}

TEST_CASE("SplitBox never splits a quantization block") {
  std::vector<Box> parts;
  SplitBox(Box{{0, 0}, {1, 2048}}, DType::kQ4_0, 100, &parts);  // 18 B/block
  int64_t blocks = 0;
  for (const Box& b : parts) {
    CHECK(b.extent[1] % 32 == 0);
    CHECK(BoxBytes(b, DType::kQ4_0) <= 100);
    blocks += b.extent[1] / 32;
  }
  CHECK(blocks == 64);
}

TEST_CASE("Plans and digests are deterministic and sensitive to layout") {
  const ModelSpec m = TwoParams();
  auto a = PlanTransfers(m, Sharded(m, 4, 2, "t", 4), {MakeInstance("r0", Sharded(m, 2, 1, "i", 8))});
  auto b = PlanTransfers(m, Sharded(m, 4, 2, "t", 4), {MakeInstance("r0", Sharded(m, 2, 1, "i", 8))});
  auto c = PlanTransfers(m, Sharded(m, 4, 2, "t", 4), {MakeInstance("r0", Sharded(m, 4, 1, "i", 8))});
  REQUIRE((a.ok() && b.ok() && c.ok()));
  CHECK(a->digest == b->digest);
  CHECK(a->digest != c->digest);
}


TEST_CASE("The plan is the same copy for copy on one planning thread or "
          "several, each route's copies in destination order") {
  // Every rank's copies are made on the planning threads and then placed
  // route by route; the order must not depend on the thread count, nor
  // stray from the destination's order inside a route.
  const ModelSpec m = TwoParams();
  // Sources replicated twice over two nodes; three instances (relay off:
  // each plans from the sources) that gather two shards per rank and
  // split them to fit 256-byte buckets: two with both ranks on one node of
  // their own, one with a rank beside sources.
  const auto sources = Sharded(m, 4, 2, "t", 4);
  std::vector<Instance> instances;
  for (int k = 0; k < 3; ++k) {
    Instance inst = MakeInstance(absl::StrCat("r", k), Sharded(m, 2, 1, "i", 8));
    if (k < 2) {
      inst.nodes = {absl::StrCat("i", k), absl::StrCat("i", k)};
    } else {
      inst.nodes = {"t0", "i2"};
    }
    instances.push_back(std::move(inst));
  }
  PlanOptions opt;
  opt.relay = false;
  opt.bucket_bytes = 256;
  SetPlanningThreads(1);
  auto one = PlanTransfers(m, sources, instances, opt);
  SetPlanningThreads(3);
  auto three = PlanTransfers(m, sources, instances, opt);
  SetPlanningThreads(0);
  REQUIRE((one.ok() && three.ok()));
  CHECK(one->digest == three->digest);
  CHECK(one->bytes_per_source_rank == three->bytes_per_source_rank);
  for (size_t k = 0; k < instances.size(); ++k) {
    const InstancePlan& a = one->instances[k];
    const InstancePlan& b = three->instances[k];
    REQUIRE(a.copies.size() == b.copies.size());
    for (size_t c = 0; c < a.copies.size(); ++c) {
      const Copy& x = a.copies[c];
      const Copy& y = b.copies[c];
      INFO("instance " << k << " copy " << c);
      CHECK(std::tie(x.param, x.src_rank, x.src_piece, x.dst_rank,
                     x.dst_piece, x.bytes) ==
            std::tie(y.param, y.src_rank, y.src_piece, y.dst_rank,
                     y.dst_piece, y.bytes));
      CHECK(a.BoxOf(x, *instances[k].layout) ==
            b.BoxOf(y, *instances[k].layout));
    }
    REQUIRE(a.routes.size() == b.routes.size());
    REQUIRE(a.buckets.size() == b.buckets.size());
    for (size_t r = 0; r < a.routes.size(); ++r) {
      CHECK(a.routes[r].src_node == b.routes[r].src_node);
      CHECK(a.routes[r].dst_node == b.routes[r].dst_node);
      CHECK(a.routes[r].bytes == b.routes[r].bytes);
    }
    // Against the layouts: each copy's box lies in its destination piece
    // and in its source piece, and a piece's copies add up to the piece.
    const std::vector<RankLayout>& dst = *instances[k].layout;
    std::map<std::pair<int32_t, int32_t>, int64_t> piece_bytes;
    for (const Copy& x : a.copies) {
      const Box& box = a.BoxOf(x, dst);
      CHECK(Contains(dst[x.dst_rank].pieces[x.dst_piece].box, box));
      CHECK(Contains(sources[x.src_rank].pieces[x.src_piece].box, box));
      CHECK(BoxBytes(box, DType::kBF16) == x.bytes);
      piece_bytes[{x.dst_rank, x.dst_piece}] += x.bytes;
    }
    for (size_t r = 0; r < dst.size(); ++r) {
      for (size_t i = 0; i < dst[r].pieces.size(); ++i) {
        CHECK(piece_bytes[{static_cast<int32_t>(r), static_cast<int32_t>(i)}] ==
              BoxBytes(dst[r].pieces[i].box, DType::kBF16));
      }
    }
    // Splits happened, the copies of one instance span several routes,
    // and inside each route they follow the destination's rank and piece
    // order (a piece's parts: shard by shard, each split in order).
    CHECK(a.boxes.size() > 0);
    CHECK(a.routes.size() > 1);
    std::map<int32_t, std::pair<int32_t, int32_t>> last;
    std::set<int32_t> ranks_in_one_route;
    for (const Bucket& bucket : a.buckets) {
      CHECK(bucket.bytes <= 256);
      for (int32_t c = bucket.first_copy;
           c < bucket.first_copy + bucket.num_copies; ++c) {
        const Copy& x = a.copies[c];
        const auto key = std::make_pair(x.dst_rank, x.dst_piece);
        auto it = last.find(bucket.route);
        if (it != last.end()) {
          CHECK(it->second <= key);
          if (it->second.first != key.first) {
            ranks_in_one_route.insert(bucket.route);
          }
        }
        last[bucket.route] = key;
      }
    }
    // Both ranks of instances 0 and 1 share a node, so some route carries
    // copies of two ranks and the rank order inside it is tested.
    if (k < 2) CHECK(!ranks_in_one_route.empty());
  }
}

TEST_CASE("Many source shards and many destination pieces plan near-linearly") {
  // One [4, n] parameter: the source holds it in n one-column pieces (a
  // shard each), the destination in n/2 two-column pieces. Looking at
  // every shard for every piece made this n^2 / 2 intersections.
  const int64_t n = 40000;
  ModelSpec m;
  m.params.push_back({"wide.weight", DType::kF32, {4, n}});
  m.BuildIndex();
  RankLayout src;
  src.rank = 0;
  src.node = "n0";
  for (int64_t c = 0; c < n; ++c) {
    Piece p = Piece::Contiguous(0, Box{{0, c}, {4, 1}}, 0, c * 16, DType::kF32);
    src.pieces.push_back(std::move(p));
  }
  RankLayout dst;
  dst.rank = 0;
  dst.node = "n0";
  for (int64_t c = 0; c < n; c += 2) {
    dst.pieces.push_back(
        Piece::Contiguous(0, Box{{0, c}, {4, 2}}, 0, c * 16, DType::kF32));
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto plan = PlanTransfers(m, {src}, {MakeInstance("wide", {dst})});
  const double s = std::chrono::duration<double>(
                       std::chrono::steady_clock::now() - t0)
                       .count();
  REQUIRE(plan.ok());
  // Each two-column piece reads its two one-column shards, in order.
  const InstancePlan& ip = plan->instances[0];
  REQUIRE(ip.copies.size() == static_cast<size_t>(n));
  CHECK(ip.copies[0].src_piece == 0);
  CHECK(ip.copies[1].src_piece == 1);
  CHECK(ip.copies[1].dst_piece == 0);
  CHECK(ip.copies[2].dst_piece == 1);
  INFO(s << " s");
  CHECK(s < 5.0);  // about 0.1 s; generous for a loaded machine
}

}  // namespace
}  // namespace ferry
