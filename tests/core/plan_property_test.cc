// Property test of the planner: random models, random source and destination
// layouts, random plan options. Each plan is executed on real byte buffers
// and every destination byte is checked against the tensor it should hold
// (tests/core/oracle.h), not against the planner's own arithmetic.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <random>

#include "absl/strings/str_cat.h"
#include "core/planner.h"
#include "core/region_copy.h"
#include "tests/core/oracle.h"

namespace ferry {
namespace {

using testing::CountWrongBytes;
using testing::FillPiece;

constexpr uint8_t kSentinel = 0xEE;

struct Case {
  ModelSpec model;
  std::vector<RankLayout> sources;
  std::vector<Instance> instances;
  PlanOptions options;
  std::string description;
};

// Cut [0, n) into `parts` contiguous ranges (some possibly empty when
// uneven), at multiples of `align`.
std::vector<std::pair<int64_t, int64_t>> Cut(std::mt19937_64& rng, int64_t n,
                                             int parts, int64_t align) {
  const int64_t units = n / align;
  std::vector<int64_t> points;
  const bool even_style = rng() % 2 == 0;
  for (int k = 1; k < parts; ++k) {
    if (even_style) {  // Megatron-style: ceil for the first ranks
      const int64_t base = units / parts, extra = units % parts;
      points.push_back(k * base + std::min<int64_t>(k, extra));
    } else {
      points.push_back(units == 0 ? 0 : static_cast<int64_t>(rng() % (units + 1)));
    }
  }
  std::sort(points.begin(), points.end());
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t prev = 0;
  for (int64_t p : points) {
    out.emplace_back(prev * align, (p - prev) * align);
    prev = p;
  }
  out.emplace_back(prev * align, (units - prev) * align);
  return out;
}

// Appends a tensor slot of `bytes` to a rank's buffer 0 with random slack,
// returning its offset.
int64_t Allocate(std::mt19937_64& rng, RankLayout& rank, int64_t bytes) {
  if (rank.buffer_bytes.empty()) rank.buffer_bytes.push_back(0);
  const int64_t offset = rank.buffer_bytes[0] + static_cast<int64_t>(rng() % 3) * 8;
  rank.buffer_bytes[0] = offset + bytes;
  return offset;
}

// A parameter group: params that share every dim but dim 0 and the dtype,
// so they can be fused along dim 0 (qkv, gate_up).
struct Group {
  std::vector<int32_t> params;
};

ModelSpec RandomModel(std::mt19937_64& rng, std::vector<Group>* groups) {
  ModelSpec model;
  const DType dtypes[] = {DType::kBF16, DType::kF32, DType::kU8,
                          DType::kF8E4M3, DType::kQ4_0, DType::kQ8_0,
                          DType::kQ4_K};
  const int num_groups = 1 + rng() % 4;
  for (int g = 0; g < num_groups; ++g) {
    const DType dtype = dtypes[rng() % 7];
    const int rank = 1 + rng() % 5;  // 1-D to 5-D
    Dims tail;
    for (int d = 1; d < rank; ++d) tail.push_back(1 + rng() % (rank > 3 ? 4 : 9));
    if (BlockElems(dtype) > 1) {
      const int64_t blocks = 1 + rng() % 3;
      if (tail.empty()) {
        tail.push_back(blocks * BlockElems(dtype));  // dim 0 is then added
      } else {
        tail.back() = blocks * BlockElems(dtype);
      }
    }
    Group group;
    const int members = 1 + rng() % 3;
    for (int m = 0; m < members; ++m) {
      ParamSpec p;
      p.name = absl::StrCat("layers.", g, ".p", m, ".weight");
      p.dtype = dtype;
      p.shape.push_back(1 + rng() % 23);
      p.shape.insert(p.shape.end(), tail.begin(), tail.end());
      group.params.push_back(static_cast<int32_t>(model.params.size()));
      model.params.push_back(std::move(p));
    }
    groups->push_back(std::move(group));
  }
  model.BuildIndex();
  return model;
}

// Shard dim and the alignment along it for a param.
std::pair<size_t, int64_t> PickDim(std::mt19937_64& rng, const ParamSpec& p) {
  const size_t d = rng() % p.shape.size();
  const int64_t align = (d + 1 == p.shape.size()) ? BlockElems(p.dtype) : 1;
  return {d, align};
}

// Random trainer layout: TP over a random dim (uneven allowed) x DP
// replicas, or a 2-D grid, or FSDP flat shards; fused groups stored as one
// local tensor per rank when sharded along dim 0.
std::vector<RankLayout> RandomSources(std::mt19937_64& rng,
                                      const ModelSpec& model,
                                      const std::vector<Group>& groups,
                                      std::string* how) {
  const int style = rng() % 3;
  const int tp = 1 + rng() % 16;
  const int dp = 1 + rng() % 3;
  std::vector<RankLayout> ranks;
  if (style == 2) {  // FSDP: flat concatenation split over world ranks
    const int world = 1 + rng() % 12;
    *how = absl::StrCat("fsdp world=", world);
    ranks.resize(world);
    for (int r = 0; r < world; ++r) {
      ranks[r].rank = r;
      ranks[r].node = absl::StrCat("t", r / 4);
    }
    for (size_t p = 0; p < model.params.size(); ++p) {
      const ParamSpec& spec = model.params[p];
      const Dims units = StorageShape(spec.shape, spec.dtype);
      const int64_t block = BlockElems(spec.dtype);
      const auto cuts = Cut(rng, Volume(units), world, 1);
      for (int r = 0; r < world; ++r) {
        const auto [begin, count] = cuts[r];
        if (count == 0) continue;
        const int64_t offset =
            Allocate(rng, ranks[r], count * UnitBytes(spec.dtype));
        int64_t at = offset;
        for (Box box : FlatRangeToBoxes(units, begin, begin + count)) {
          const int64_t bytes = Volume(box) * UnitBytes(spec.dtype);
          box.offset.back() *= block;
          box.extent.back() *= block;
          ranks[r].pieces.push_back(Piece::Contiguous(
              static_cast<int32_t>(p), box, 0, at, spec.dtype));
          at += bytes;
        }
      }
    }
    return ranks;
  }
  *how = absl::StrCat(style == 0 ? "tp=" : "grid tp=", tp, " dp=", dp);
  ranks.resize(tp * dp);
  for (int r = 0; r < tp * dp; ++r) {
    ranks[r].rank = r;
    ranks[r].node = absl::StrCat("t", r / 8);
  }
  for (const Group& g : groups) {
    const ParamSpec& first = model.params[g.params[0]];
    auto [dim, align] = PickDim(rng, first);
    const bool fuse = dim == 0 && g.params.size() > 1 && rng() % 2 == 0;
    // Shard boxes per tp index, per param.
    std::vector<std::vector<Box>> boxes(tp);
    for (int32_t p : g.params) {
      const ParamSpec& spec = model.params[p];
      auto cuts = Cut(rng, spec.shape[dim], tp, align);
      std::vector<std::pair<int64_t, int64_t>> cuts2(tp, {0, 0});
      size_t dim2 = dim;
      if (style == 1 && spec.shape.size() > 1) {  // 2-D grid: also split dim2
        dim2 = (dim + 1) % spec.shape.size();
      }
      for (int t = 0; t < tp; ++t) {
        Box box = FullBox(spec.shape);
        box.offset[dim] = cuts[t].first;
        box.extent[dim] = cuts[t].second;
        boxes[t].push_back(box);
      }
      if (dim2 != dim) {
        // Split each tp box in two along dim2 and give the halves to two
        // different tp indices when tp is even: still an exact tiling.
        const int64_t a2 = (dim2 + 1 == spec.shape.size()) ? BlockElems(spec.dtype) : 1;
        if (tp % 2 == 0 && spec.shape[dim2] >= 2 * a2) {
          const int64_t half = (spec.shape[dim2] / a2 / 2) * a2;
          for (int t = 0; t < tp; t += 2) {
            Box& lo = boxes[t].back();
            Box& hi = boxes[t + 1].back();
            Box merged = lo;
            merged.extent[dim] = lo.extent[dim] + hi.extent[dim];
            lo = merged;
            hi = merged;
            lo.extent[dim2] = half;
            hi.offset[dim2] = half;
            hi.extent[dim2] = spec.shape[dim2] - half;
          }
        }
      }
    }
    for (int t = 0; t < tp; ++t) {
      for (int rep = 0; rep < dp; ++rep) {
        RankLayout& rank = ranks[rep * tp + t];
        if (fuse) {
          // One local tensor: the params' shards concatenated along dim 0.
          Dims local = boxes[t][0].extent;
          local[0] = 0;
          for (const Box& b : boxes[t]) local[0] += b.extent[0];
          const int64_t offset = Allocate(
              rng, rank, Volume(StorageShape(local, first.dtype)) *
                             UnitBytes(first.dtype));
          int64_t row = 0;
          for (size_t m = 0; m < g.params.size(); ++m) {
            Dims at(local.size(), 0);
            at[0] = row;
            rank.pieces.push_back(Piece::InLocalTensor(
                g.params[m], boxes[t][m], 0, offset, local, at, first.dtype));
            row += boxes[t][m].extent[0];
          }
        } else {
          for (size_t m = 0; m < g.params.size(); ++m) {
            const ParamSpec& spec = model.params[g.params[m]];
            const int64_t offset =
                Allocate(rng, rank, BoxBytes(boxes[t][m], spec.dtype));
            rank.pieces.push_back(Piece::Contiguous(
                g.params[m], boxes[t][m], 0, offset, spec.dtype));
          }
        }
      }
    }
  }
  return ranks;
}

// Random destination layout: TP over a random dim with padding in the local
// tensor, fused groups along dim 0, replicated params, fallback params in
// staging, and params the instance does not want at all.
std::vector<RankLayout> RandomDestination(std::mt19937_64& rng,
                                          const ModelSpec& model,
                                          const std::vector<Group>& groups,
                                          int tp, int node_base) {
  std::vector<RankLayout> ranks(tp);
  for (int r = 0; r < tp; ++r) {
    ranks[r].rank = r;
    ranks[r].node = absl::StrCat("i", node_base + r / 4);
  }
  std::vector<uint32_t> next_staging(tp, kStagingBufferBit);
  for (const Group& g : groups) {
    const ParamSpec& first = model.params[g.params[0]];
    const int mode = rng() % 8;  // 0-3 shard, 4 fused, 5 replicate, 6 fallback, 7 skip
    if (mode == 7 && groups.size() > 1) continue;
    if (mode == 6) {
      for (int r = 0; r < tp; ++r) {
        for (int32_t p : g.params) {
          ranks[r].pieces.push_back(Piece::Contiguous(
              p, FullBox(model.params[p].shape), next_staging[r]++, 0,
              model.params[p].dtype));
        }
      }
      continue;
    }
    if (mode == 5) {
      for (int r = 0; r < tp; ++r) {
        for (int32_t p : g.params) {
          const int64_t offset = Allocate(
              rng, ranks[r],
              BoxBytes(FullBox(model.params[p].shape), model.params[p].dtype));
          ranks[r].pieces.push_back(Piece::Contiguous(
              p, FullBox(model.params[p].shape), 0, offset,
              model.params[p].dtype));
        }
      }
      continue;
    }
    auto [dim, align] = PickDim(rng, first);
    if (mode == 4) dim = 0, align = first.shape.size() == 1 ? BlockElems(first.dtype) : 1;
    // vLLM-style even split with padding: local = ceil(n / tp) (aligned).
    std::vector<Dims> local_shapes;
    std::vector<std::vector<Box>> boxes(tp);
    for (int32_t p : g.params) {
      const ParamSpec& spec = model.params[p];
      const int64_t units = spec.shape[dim] / align;
      const int64_t per = (units + tp - 1) / tp;
      for (int r = 0; r < tp; ++r) {
        Box box = FullBox(spec.shape);
        const int64_t lo = std::min(units, r * per), hi = std::min(units, (r + 1) * per);
        box.offset[dim] = lo * align;
        box.extent[dim] = (hi - lo) * align;
        boxes[r].push_back(box);
      }
      Dims local = spec.shape;
      local[dim] = per * align;
      local_shapes.push_back(local);
    }
    for (int r = 0; r < tp; ++r) {
      if (mode == 4) {
        Dims fused = local_shapes[0];
        fused[0] = 0;
        for (const Dims& l : local_shapes) fused[0] += l[0];
        const int64_t offset = Allocate(
            rng, ranks[r],
            Volume(StorageShape(fused, first.dtype)) * UnitBytes(first.dtype));
        int64_t row = 0;
        for (size_t m = 0; m < g.params.size(); ++m) {
          Dims at(fused.size(), 0);
          at[0] = row;
          ranks[r].pieces.push_back(Piece::InLocalTensor(
              g.params[m], boxes[r][m], 0, offset, fused, at, first.dtype));
          row += local_shapes[m][0];
        }
        continue;
      }
      for (size_t m = 0; m < g.params.size(); ++m) {
        const ParamSpec& spec = model.params[g.params[m]];
        const int64_t offset = Allocate(
            rng, ranks[r],
            Volume(StorageShape(local_shapes[m], spec.dtype)) * UnitBytes(spec.dtype));
        ranks[r].pieces.push_back(Piece::InLocalTensor(
            g.params[m], boxes[r][m], 0, offset, local_shapes[m],
            Dims(local_shapes[m].size(), 0), spec.dtype));
      }
    }
  }
  return ranks;
}

Case RandomCase(uint64_t seed) {
  std::mt19937_64 rng(seed);
  Case c;
  std::vector<Group> groups;
  c.model = RandomModel(rng, &groups);
  std::string src_how;
  c.sources = RandomSources(rng, c.model, groups, &src_how);
  const int num_layouts = 1 + rng() % 2;
  std::vector<std::shared_ptr<const std::vector<RankLayout>>> layouts;
  std::vector<int> tps;
  for (int l = 0; l < num_layouts; ++l) {
    const int tp = 1 + rng() % 16;
    tps.push_back(tp);
    layouts.push_back(std::make_shared<std::vector<RankLayout>>(
        RandomDestination(rng, c.model, groups, tp, 10 * l)));
  }
  const int num_instances = 1 + rng() % 4;
  for (int k = 0; k < num_instances; ++k) {
    Instance inst;
    inst.id = absl::StrCat("inst", k);
    const int l = k % num_layouts;
    inst.layout = layouts[l];
    inst.nodes.clear();
    for (size_t r = 0; r < layouts[l]->size(); ++r) {
      // Replicas run elsewhere: some share the trainer's nodes.
      inst.nodes.push_back(rng() % 3 == 0 ? absl::StrCat("t", r % 2)
                                          : absl::StrCat("i", 100 * k + r / 4));
    }
    c.instances.push_back(std::move(inst));
  }
  c.options.bucket_bytes = 64 + rng() % 4096;
  c.options.relay = rng() % 2 == 0;
  c.description = absl::StrCat("seed ", seed, ": ", c.model.params.size(),
                               " params, sources ", src_how, ", ",
                               num_instances, " instances, tp ",
                               tps[0], num_layouts > 1 ? absl::StrCat("/", tps[1]) : "",
                               ", bucket ", c.options.bucket_bytes,
                               c.options.relay ? ", relay" : "");
  return c;
}

using Buffers = std::vector<std::vector<uint8_t>>;  // by rank, buffer 0

// Staging buffers of one destination rank, by staging id.
struct RankMemory {
  std::vector<uint8_t> registered;
  std::map<uint32_t, std::vector<uint8_t>> staging;
  uint8_t* Buffer(const ModelSpec& model, const Piece& piece) {
    if (piece.buffer & kStagingBufferBit) {
      auto& s = staging[piece.buffer];
      if (s.empty()) {
        s.assign(BoxBytes(FullBox(model.params[piece.param].shape),
                          model.params[piece.param].dtype),
                 kSentinel);
      }
      return s.data();
    }
    return registered.data();
  }
};

// Executes the plan: stage-0 copies (through pack/unpack when nodes
// differ, straight copies when they do not), then relays in stage order.
void Execute(const Case& c, const Plan& plan, std::vector<std::vector<uint8_t>>& src,
             std::vector<std::vector<RankMemory>>& dst) {
  std::vector<uint8_t> bucket_buffer;
  for (size_t k = 0; k < plan.instances.size(); ++k) {
    const InstancePlan& ip = plan.instances[k];
    const auto& layout = *c.instances[k].layout;
    for (const Bucket& b : ip.buckets) {
      const Route& ch = ip.routes[b.route];
      const bool packed = ch.src_node != ch.dst_node;
      bucket_buffer.assign(b.bytes, 0);
      int64_t at = 0;
      for (int32_t i = b.first_copy; i < b.first_copy + b.num_copies; ++i) {
        const Copy& copy = ip.copies[i];
        const Box& box = ip.BoxOf(copy, layout);
        const Piece& sp = c.sources[copy.src_rank].pieces[copy.src_piece];
        const Piece& dp = layout[copy.dst_rank].pieces[copy.dst_piece];
        const DType dtype = c.model.params[copy.param].dtype;
        uint8_t* dbuf = dst[k][copy.dst_rank].Buffer(c.model, dp);
        if (packed) {
          at += PackBox(src[copy.src_rank].data(), sp, box, dtype,
                        bucket_buffer.data() + at);
        } else {
          CopyBoxBetweenPieces(src[copy.src_rank].data(), sp, dbuf, dp,
                               box, dtype);
        }
      }
      if (!packed) continue;
      at = 0;
      for (int32_t i = b.first_copy; i < b.first_copy + b.num_copies; ++i) {
        const Copy& copy = ip.copies[i];
        const Piece& dp = layout[copy.dst_rank].pieces[copy.dst_piece];
        at += UnpackBox(bucket_buffer.data() + at,
                        dst[k][copy.dst_rank].Buffer(c.model, dp), dp,
                        ip.BoxOf(copy, layout), c.model.params[copy.param].dtype);
      }
      REQUIRE(at == b.bytes);
    }
  }
  // Relays, in stage order (a parent is always planned before its child).
  std::vector<size_t> order(plan.instances.size());
  for (size_t k = 0; k < order.size(); ++k) order[k] = k;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return plan.instances[a].stage < plan.instances[b].stage;
  });
  for (size_t k : order) {
    const InstancePlan& ip = plan.instances[k];
    if (ip.relay_from < 0) continue;
    const auto& layout = *c.instances[k].layout;
    for (size_t r = 0; r < layout.size(); ++r) {
      for (const Piece& p : layout[r].pieces) {
        CopyBoxBetweenPieces(dst[ip.relay_from][r].Buffer(c.model, p), p,
                             dst[k][r].Buffer(c.model, p), p, p.box,
                             c.model.params[p.param].dtype);
      }
    }
  }
}

TEST_CASE("Plans move every destination byte from the right source byte") {
  constexpr int kCases = 600;
  int relayed = 0, packed_buckets = 0, fallback_pieces = 0, quantized = 0;
  int alike_pairs = 0;
  for (uint64_t seed = 1; seed <= kCases; ++seed) {
    Case c = RandomCase(seed);
    INFO(c.description);
    absl::StatusOr<Plan> together =
        PlanTransfers(c.model, c.sources, c.instances, c.options);
    REQUIRE(together.ok());
    // The same instances planned one at a time from the sources, as ferryd
    // plans a relayed replica whose relay failed.
    absl::StatusOr<std::unique_ptr<const SourcePlanner>> planner =
        SourcePlanner::Create(c.model, c.sources, c.options);
    REQUIRE(planner.ok());
    Plan alone;
    for (const Instance& inst : c.instances) {
      alone.instances.push_back((*planner)->PlanAlone(inst));
      // Exactly what a plan of that instance alone, relays off, holds.
      PlanOptions direct = c.options;
      direct.relay = false;
      absl::StatusOr<Plan> single =
          PlanTransfers(c.model, c.sources, {inst}, direct);
      REQUIRE(single.ok());
      Plan one;
      one.instances.push_back(alone.instances.back());
      one.bucket_bytes = single->bucket_bytes;
      one.source_bytes = single->source_bytes;
      one.bytes_per_source_rank = single->bytes_per_source_rank;
      CHECK(PlanDigest(one) == single->digest);
    }
    // A replica that reads alike with an earlier one: its plan from the
    // other's, sharing the copies, is the plan it would get alone.
    for (size_t k = 0; k < c.instances.size(); ++k) {
      for (size_t j = 0; j < k; ++j) {
        if (!(*planner)->ReadAlike(c.instances[j], c.instances[k])) continue;
        ++alike_pairs;
        Plan derived, own;
        derived.instances.push_back(
            (*planner)->PlanAlike(alone.instances[j], c.instances[k]));
        own.instances.push_back(alone.instances[k]);
        CHECK(derived.instances[0].copies.SharesWith(alone.instances[j].copies));
        CHECK(PlanDigest(derived) == PlanDigest(own));
        // Planned together without relays, the two share their copies.
        if (!c.options.relay) {
          CHECK(together->instances[k].copies.SharesWith(
              together->instances[j].copies));
        }
      }
    }
    for (const Plan* plan : {&*together, &alone}) {
      INFO((plan == &alone ? "each instance alone" : "all instances at once"));
      // Source memory holds the oracle tensor's bytes wherever a piece says.
      std::vector<std::vector<uint8_t>> src(c.sources.size());
      for (size_t r = 0; r < c.sources.size(); ++r) {
        src[r].assign(c.sources[r].buffer_bytes.empty() ? 0 : c.sources[r].buffer_bytes[0], 0);
        for (const Piece& p : c.sources[r].pieces) {
          FillPiece(c.model.params[p.param], p.param, p, src[r].data());
        }
      }
      std::vector<std::vector<RankMemory>> dst(c.instances.size());
      for (size_t k = 0; k < c.instances.size(); ++k) {
        for (const RankLayout& rank : *c.instances[k].layout) {
          RankMemory m;
          m.registered.assign(rank.buffer_bytes.empty() ? 0 : rank.buffer_bytes[0], kSentinel);
          dst[k].push_back(std::move(m));
        }
      }
      Execute(c, *plan, src, dst);
      // Every destination byte equals the tensor's byte.
      for (size_t k = 0; k < c.instances.size(); ++k) {
        const InstancePlan& ip = plan->instances[k];
        if (ip.relay_from >= 0) ++relayed;
        for (const Bucket& b : ip.buckets) {
          const Route& route = ip.routes[b.route];
          if (route.src_node != route.dst_node) ++packed_buckets;
          CHECK((b.bytes <= c.options.bucket_bytes || b.num_copies == 1));
          // Every copy of a bucket runs between its route's nodes (shared
          // copies carry the routes of the instance that holds them).
          for (int32_t i = b.first_copy; i < b.first_copy + b.num_copies;
               ++i) {
            const Copy& copy = ip.copies[i];
            CHECK(c.sources[copy.src_rank].node == route.src_node);
            CHECK(c.instances[k].node(copy.dst_rank) == route.dst_node);
          }
        }
        int64_t expected_bytes = 0;
        const auto& layout = *c.instances[k].layout;
        for (size_t r = 0; r < layout.size(); ++r) {
          std::vector<bool> covered(dst[k][r].registered.size(), false);
          for (const Piece& p : layout[r].pieces) {
            const ParamSpec& spec = c.model.params[p.param];
            if (p.buffer & kStagingBufferBit) ++fallback_pieces;
            if (BlockElems(spec.dtype) > 1) ++quantized;
            expected_bytes += BoxBytes(p.box, spec.dtype);
            const int64_t wrong = CountWrongBytes(
                spec, p.param, p, dst[k][r].Buffer(c.model, p));
            INFO("instance " << k << " rank " << r << " param " << spec.name
                             << " box " << BoxToString(p.box));
            CHECK(wrong == 0);
            if (!(p.buffer & kStagingBufferBit)) {
              testing::ForEachUnit(spec, p, [&](int64_t, int64_t addr) {
                for (int64_t b = 0; b < UnitBytes(spec.dtype); ++b) {
                  covered[addr + b] = true;
                }
              });
            }
          }
          // Bytes no piece claims were never written (padding stays padding).
          for (size_t i = 0; i < covered.size(); ++i) {
            if (!covered[i] && dst[k][r].registered[i] != kSentinel) {
              FAIL("instance " << k << " rank " << r << " byte " << i
                               << " outside every piece was written");
            }
          }
        }
        // Exactly one source per destination byte: the plan moves exactly
        // the bytes the pieces hold, no more.
        CHECK(ip.bytes == expected_bytes);
      }
    }
    // Determinism: planning again gives the same digest.
    CHECK(PlanTransfers(c.model, c.sources, c.instances, c.options)->digest ==
          together->digest);
  }
  // The generator really exercised the interesting paths.
  CHECK(relayed > 50);
  CHECK(alike_pairs > 20);
  CHECK(packed_buckets > 500);
  CHECK(fallback_pieces > 100);
  CHECK(quantized > 100);
}

}  // namespace
}  // namespace ferry
