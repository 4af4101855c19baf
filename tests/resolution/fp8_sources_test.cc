// FP8 in flight as sources (core/fp8_sources.h), end to end in process: a
// bf16 trainer whose shards cut 128x128 blocks (TP with 64-row shards of a
// 384-row weight; FSDP flat shards at arbitrary offsets) into FP8 engine
// instances at TP 1, 2 and 3. Resolution, the derived parameters and
// quantizer ranks, core's planner, the quantize step and the plan's copies
// (CopyBoxBetweenPieces) run as the daemon will run them; every live FP8
// byte and scale is then compared with the rule written from its
// definition (tests/core/fp8_oracle.h) applied to the whole trainer tensor,
// narrowed as an FP8 engine's loader would hold it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "core/fp8_sources.h"
#include "core/fp8_split.h"
#include "core/layout_resolution.h"
#include "core/planner.h"
#include "core/region_copy.h"
#include "tests/core/fp8_oracle.h"

namespace ferry {
namespace {

using fp8_oracle::ToBf16Truncated;

constexpr int64_t kBlock = 128;

// The trainer's tensors, bf16, and the oracle's quantization of each.
struct Global {
  Dims shape;
  std::vector<uint16_t> bf16;
  std::vector<uint8_t> fp8;
  std::vector<float> scales;  // [ceil(rows/128), ceil(cols/128)]
};

Global Make(Dims shape, uint32_t seed) {
  Global g;
  g.shape = shape;
  g.bf16.resize(shape[0] * shape[1]);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (uint16_t& v : g.bf16) v = ToBf16Truncated(normal(rng));
  g.bf16[seed % g.bf16.size()] = ToBf16Truncated(11.0f);  // one block's outlier
  fp8_oracle::OracleBlocks(g.bf16, {shape[0], shape[1], kBlock, kBlock},
                           fp8_oracle::kE4M3Spec, 448.0f, &g.fp8, &g.scales);
  return g;
}

// A rank's memory: buffer 0 holds its pieces (or live tensors) in order.
struct Memory {
  std::vector<std::vector<uint8_t>> buffers;
};

// The trainer: 6 ranks, 0-2 on node train-0, 3-5 on train-1. "a" [384,
// 256] in TP 6 row shards of 64 rows (every block straddles two ranks,
// those of rows 128-255 two nodes);
// "b" [256, 512] in FSDP flat shards over ranks 0-2 at arbitrary offsets;
// "norm" [256] whole on rank 5.
struct Trainer {
  ModelSpec model;
  std::map<std::string, Global> globals;
  std::vector<RankLayout> ranks;
  std::vector<Memory> memory;

  Trainer() {
    globals["a"] = Make({384, 256}, 3);
    globals["b"] = Make({256, 512}, 5);
    model.params = {{"a", DType::kBF16, {384, 256}},
                    {"b", DType::kBF16, {256, 512}},
                    {"norm", DType::kBF16, {256}}};
    model.BuildIndex();
    norm.resize(256);
    for (int i = 0; i < 256; ++i) norm[i] = ToBf16Truncated(1.0f + i / 256.0f);
    ranks.resize(6);
    memory.resize(6);
    for (int r = 0; r < 6; ++r) {
      ranks[r].rank = r;
      ranks[r].node = r < 3 ? "train-0" : "train-1";
      Box box{{64 * r, 0}, {64, 256}};
      Add(r, 0, box);
    }
    const int64_t cuts[] = {0, 40001, 100003, 256 * 512};
    for (int r = 0; r < 3; ++r) {
      for (const Box& box : FlatRangeToBoxes({256, 512}, cuts[r], cuts[r + 1])) {
        Add(r, 1, box);
      }
    }
    Add(5, 2, FullBox({256}));
  }

  // Appends the box of parameter `param` to rank r, filled with its values.
  void Add(int r, int32_t param, const Box& box) {
    std::vector<uint8_t>& buf = Buffer(r);
    const int64_t at = static_cast<int64_t>(buf.size());
    const Piece piece = Piece::Contiguous(param, box, 0, at, DType::kBF16);
    buf.resize(at + BoxBytes(box, DType::kBF16));
    const std::vector<uint16_t>& values =
        param == 2 ? norm : globals[model.params[param].name].bf16;
    const Piece whole = Piece::Contiguous(
        param, FullBox(model.params[param].shape), 0, 0, DType::kBF16);
    CopyBoxBetweenPieces(reinterpret_cast<const uint8_t*>(values.data()),
                         whole, buf.data(), piece, box, DType::kBF16);
    ranks[r].pieces.push_back(piece);
    ranks[r].buffer_bytes = {static_cast<int64_t>(buf.size())};
  }
  std::vector<uint8_t>& Buffer(int r) {
    if (memory[r].buffers.empty()) memory[r].buffers.emplace_back();
    return memory[r].buffers[0];
  }

  std::vector<uint16_t> norm;
};

// One engine rank's table: FP8 weights with their scales, and the norm in
// bf16, one after another in buffer 0; `expected` the live bytes an FP8
// engine's loader would hold.
struct EngineRank {
  EngineTable table;
  std::map<std::string, std::vector<uint8_t>> expected;
  int64_t next = 0;

  EngineParam& Add(const std::string& name, DType dtype, Dims local,
                   LoaderKind loader, std::vector<uint8_t> want) {
    EngineParam p;
    p.name = name;
    p.dtype = dtype;
    p.local_shape = local;
    p.loader = loader;
    p.tp_size = table.tp_size;
    p.byte_offset = next;
    int64_t n = UnitBytes(dtype);
    for (int64_t d : local) n *= d;
    next += (n + 63) / 64 * 64;
    expected[name] = std::move(want);
    table.params.push_back(p);
    return table.params.back();
  }
};

// Rows [r0, r0 + n) x cols [c0, c0 + m) of a row-major [.., cols] tensor of
// `unit`-byte elements.
std::vector<uint8_t> Slice(const void* data, int64_t cols, int64_t unit,
                           int64_t r0, int64_t n, int64_t c0, int64_t m) {
  std::vector<uint8_t> out;
  const uint8_t* base = static_cast<const uint8_t*>(data);
  for (int64_t r = r0; r < r0 + n; ++r) {
    const uint8_t* row = base + (r * cols + c0) * unit;
    out.insert(out.end(), row, row + m * unit);
  }
  return out;
}

// The quantize step as the daemons run it, each node reading only its own
// trainer ranks' memory: a tensor whole on one node quantized there; a
// split one's block amaxes read on each node that holds parts of it,
// combined (the largest bits), then each node's parts quantized with them,
// the scales written on the tensor's node. The sources' memory comes
// back: the trainer's, then each quantizer rank's.
std::vector<Memory> QuantizeStep(const Trainer& t, const Fp8Sources& s) {
  std::vector<Memory> sources = t.memory;
  for (size_t r = t.memory.size(); r < s.sources.size(); ++r) {
    Memory quantizer;
    for (int64_t n : s.sources[r].buffer_bytes) quantizer.buffers.emplace_back(n);
    sources.push_back(std::move(quantizer));
  }
  // Node n's view: its trainer ranks' bases, null elsewhere.
  auto bases_on = [&](const std::string& node) {
    std::vector<std::vector<const uint8_t*>> bases;
    for (size_t r = 0; r < t.memory.size(); ++r) {
      const bool here = t.ranks[r].node == node && !t.memory[r].buffers.empty();
      bases.push_back({here ? t.memory[r].buffers[0].data() : nullptr});
    }
    return bases;
  };
  auto buffers_on = [&](const std::string& node) -> Memory& {
    for (size_t r = t.memory.size(); r < s.sources.size(); ++r) {
      if (s.sources[r].node == node) return sources[r];
    }
    FAIL("no quantizer rank on " << node);
    return sources[0];
  };
  const std::vector<std::vector<HeldPiece>> held =
      HeldPieces(s.quantized, s.sources);
  for (size_t i = 0; i < s.quantized.size(); ++i) {
    const QuantizedParam& q = s.quantized[i];
    if (!q.split()) {
      const auto bases = bases_on(q.node);
      REQUIRE(CheckReadable(s.model, q, held[i], bases).ok());
      Memory& out = buffers_on(q.node);
      REQUIRE(QuantizeParam(s.model, q, held[i], bases,
                            out.buffers[0].data(), out.buffers[1].data())
                  .ok());
      continue;
    }
    std::set<std::string> nodes;
    for (const QuantizedPart& part : q.parts) nodes.insert(part.node);
    const Dims& grid = s.model.params[q.scale_param].shape;
    std::vector<uint32_t> max_bits(grid[0] * grid[1], 0);
    for (const std::string& node : nodes) {
      const auto bases = bases_on(node);
      REQUIRE(CheckPartsReadable(s.model, q, node, held[i],
                                 [&](const HeldPiece& h) {
                                   return bases[h.rank][0] != nullptr;
                                 })
                  .ok());
      REQUIRE(PartialAmax(s.model, q, node, held[i], bases, max_bits.data())
                  .ok());
    }
    for (const std::string& node : nodes) {
      Memory& out = buffers_on(node);
      REQUIRE(QuantizeParts(s.model, q, node, held[i], bases_on(node),
                            max_bits.data(), out.buffers[0].data(),
                            node == q.node ? out.buffers[1].data() : nullptr)
                  .ok());
    }
  }
  return sources;
}

// A TP `tp` instance: "a" column-parallel (tp 1 or 3), "b" row-parallel
// (tp 1 or 2), each FP8 with scales, and the norm replicated in bf16.
std::vector<EngineTable> Fp8Instance(const Trainer& t, int tp,
                                  std::vector<EngineRank>* ranks) {
  ranks->assign(tp, EngineRank{});
  std::vector<EngineTable> tables;
  for (int r = 0; r < tp; ++r) {
    EngineRank& e = (*ranks)[r];
    e.table.tp_rank = r;
    e.table.tp_size = tp;
    e.table.node = "infer-" + std::to_string(r % 2);
    const Global& a = t.globals.at("a");
    const Global& b = t.globals.at("b");
    if (tp != 2) {
      const int64_t rows = 384 / tp;
      e.Add("a", DType::kF8E4M3, {rows, 256}, LoaderKind::kColumn,
            Slice(a.fp8.data(), 256, 1, r * rows, rows, 0, 256))
          .fp8.scale = "a_scale_inv";
      e.Add("a_scale_inv", DType::kF32, {rows / kBlock, 2}, LoaderKind::kCustom,
            Slice(a.scales.data(), 2, 4, r * rows / kBlock, rows / kBlock, 0, 2));
    }
    if (tp != 3) {
      const int64_t cols = 512 / tp;
      EngineParam& w = e.Add("b", DType::kF8E4M3, {256, cols}, LoaderKind::kRow,
                             Slice(b.fp8.data(), 512, 1, 0, 256, r * cols, cols));
      w.shard_dim = 1;
      w.fp8.scale = "b_scale_inv";
      e.Add("b_scale_inv", DType::kF32, {2, cols / kBlock}, LoaderKind::kCustom,
            Slice(b.scales.data(), 4, 4, 0, 2, r * cols / kBlock, cols / kBlock));
    }
    e.Add("norm", DType::kBF16, {256}, LoaderKind::kReplicated,
          Slice(t.norm.data(), 256, 2, 0, 1, 0, 256));
    e.table.buffer_bytes = {e.next};
    tables.push_back(e.table);
  }
  return tables;
}

TEST_CASE("a bf16 trainer whose shards cut blocks, into FP8 instances at TP "
          "1, 2 and 3: every live FP8 byte and scale is the whole tensor's "
          "quantization, and FP8 is what the plan moves") {
  Trainer t;
  std::vector<std::vector<EngineRank>> engines(3);
  std::vector<ResolvedInstance> resolved;
  std::vector<std::vector<RankLayout>> layouts;
  const int tps[] = {1, 2, 3};
  for (int i = 0; i < 3; ++i) {
    const std::vector<EngineTable> tables = Fp8Instance(t, tps[i], &engines[i]);
    absl::StatusOr<ResolvedInstance> r = ResolveDestinationLayout(t.model, tables);
    INFO("tp " << tps[i] << ": " << r.status());
    REQUIRE(r.ok());
    std::vector<RankLayout> layout;
    for (const ResolvedRank& rank : r->ranks) layout.push_back(rank.layout);
    layouts.push_back(std::move(layout));
    resolved.push_back(*std::move(r));
  }
  std::vector<const ResolvedInstance*> pointers;
  for (const ResolvedInstance& r : resolved) pointers.push_back(&r);
  absl::StatusOr<Fp8Sources> s =
      AddFp8Sources(t.model, t.ranks, pointers, &layouts);
  INFO(s.status());
  REQUIRE(s.ok());

  // One pair per tensor, each on train-0: it holds 3 of a's 6 shards (as
  // train-1 does: the tie goes to the first name) and all of b. b is
  // whole there; a is split: train-0 quantizes rows 0-191 and keeps the
  // scales, train-1 rows 192-383, and the blocks of rows 128-255 have
  // elements on both. One quantizer rank per node, after the trainer's 6.
  REQUIRE(s->quantized.size() == 2);
  for (const QuantizedParam& q : s->quantized) {
    CHECK(q.node == "train-0");
    CHECK(q.source_rank == 6);
  }
  REQUIRE(s->sources.size() == 8);
  CHECK(s->sources[6].node == "train-0");
  CHECK(s->sources[7].node == "train-1");
  const QuantizedParam& a = s->quantized[0];
  CHECK(!s->quantized[1].split());
  REQUIRE(a.split());
  REQUIRE(a.parts.size() == 6);
  for (size_t k = 0; k < 6; ++k) {
    CHECK(a.parts[k].node == (k < 3 ? "train-0" : "train-1"));
    CHECK(a.parts[k].source_rank == (k < 3 ? 6 : 7));
    CHECK(a.parts[k].box == Box{{64 * static_cast<int64_t>(k), 0}, {64, 256}});
  }
  // train-1's quantizer holds its three parts' FP8 only: 192 x 256 bytes.
  CHECK(s->sources[7].buffer_bytes == std::vector<int64_t>{192 * 256, 0});
  CHECK(s->model.params[s->quantized[0].fp8_param].name == "a@f8_e4m3:128x128");
  CHECK(s->model.params[s->quantized[0].scale_param].shape == Dims{3, 2});

  // Plan with core's planner, as PlanCache will.
  std::vector<Instance> instances;
  for (int i = 0; i < 3; ++i) {
    instances.push_back(Instance{
        "fp8-tp" + std::to_string(tps[i]),
        std::make_shared<const std::vector<RankLayout>>(layouts[i]), {}});
  }
  PlanOptions options;
  options.relay = false;
  absl::StatusOr<Plan> plan =
      PlanTransfers(s->model, s->sources, instances, options);
  INFO(plan.status());
  REQUIRE(plan.ok());

  // The quantize step on each node (its own trainer ranks' memory only),
  // then the copies.
  const std::vector<Memory> sources = QuantizeStep(t, *s);

  for (int i = 0; i < 3; ++i) {
    INFO("instance tp " << tps[i]);
    const InstancePlan& ip = plan->instances[i];
    std::vector<std::vector<uint8_t>> live;
    for (const EngineRank& e : engines[i]) {
      live.emplace_back(e.table.buffer_bytes[0], 0xEE);
    }
    int64_t fp8_bytes = 0, scale_bytes = 0;
    for (const Copy& c : ip.copies) {
      const Piece& src = s->sources[c.src_rank].pieces[c.src_piece];
      const Piece& dst = layouts[i][c.dst_rank].pieces[c.dst_piece];
      const DType dtype = s->model.params[c.param].dtype;
      CopyBoxBetweenPieces(sources[c.src_rank].buffers[src.buffer].data(), src,
                           live[c.dst_rank].data(), dst, ip.BoxOf(c, layouts[i]),
                           dtype);
      if (dtype == DType::kF8E4M3) fp8_bytes += c.bytes;
      if (dtype == DType::kF32) scale_bytes += c.bytes;
      // No bf16 byte of a quantized tensor is moved.
      CHECK((c.param != 0 && c.param != 1));
    }
    // FP8: one byte per element of what the instance holds.
    const int64_t elems = (tps[i] != 2 ? 384 * 256 : 0) +
                          (tps[i] != 3 ? 256 * 512 : 0);
    CHECK(fp8_bytes == elems);
    CHECK(scale_bytes == 4 * ((tps[i] != 2 ? 6 : 0) + (tps[i] != 3 ? 8 : 0)));
    for (size_t r = 0; r < engines[i].size(); ++r) {
      for (const EngineParam& p : engines[i][r].table.params) {
        INFO("rank " << r << " " << p.name);
        const std::vector<uint8_t>& want = engines[i][r].expected.at(p.name);
        const std::vector<uint8_t> got(
            live[r].begin() + p.byte_offset,
            live[r].begin() + p.byte_offset + static_cast<int64_t>(want.size()));
        int64_t wrong = 0;
        for (size_t k = 0; k < want.size(); ++k) wrong += got[k] != want[k];
        CHECK(wrong == 0);
      }
    }
  }
}

TEST_CASE("a quantized fallback: an FP8 weight its loader transforms "
          "arrives whole in staging, FP8 elements and scales as the rule "
          "gives them for the whole tensor") {
  Trainer t;
  std::vector<EngineRank> engine;
  std::vector<EngineTable> tables = Fp8Instance(t, 1, &engine);
  for (EngineParam& p : tables[0].params) {
    if (p.name == "a") p.flags |= kFlagTransformed;
  }
  absl::StatusOr<ResolvedInstance> r = ResolveDestinationLayout(t.model, tables);
  INFO(r.status());
  REQUIRE(r.ok());
  // The names have no module ("a", "b", "norm": all the root), so by the
  // module rule everything goes through the loader: a and b quantized
  // (elements and scales each), the norm as it is.
  const std::vector<FallbackTensor>& fallback = r->ranks[0].fallback;
  REQUIRE(fallback.size() == 5);
  CHECK(r->ranks[0].quantized.empty());
  std::vector<std::vector<RankLayout>> layouts = {{r->ranks[0].layout}};
  absl::StatusOr<Fp8Sources> s = AddFp8Sources(t.model, t.ranks, {&*r}, &layouts);
  INFO(s.status());
  REQUIRE(s.ok());
  REQUIRE(s->quantized.size() == 2);  // a (through the loader) and b
  absl::StatusOr<Plan> plan = PlanTransfers(
      s->model, s->sources,
      {Instance{"fp8", std::make_shared<const std::vector<RankLayout>>(layouts[0]),
                {}}},
      PlanOptions{});
  INFO(plan.status());
  REQUIRE(plan.ok());
  const std::vector<Memory> sources = QuantizeStep(t, *s);
  // The live buffer, and one staging buffer per fallback tensor, sized as
  // FallbackSpec says.
  std::vector<uint8_t> live(engine[0].table.buffer_bytes[0], 0xEE);
  std::vector<std::vector<uint8_t>> staging;
  for (const FallbackTensor& f : fallback) {
    const ParamSpec spec = FallbackSpec(t.model, f);
    staging.emplace_back(BoxBytes(FullBox(spec.shape), spec.dtype), 0xEE);
  }
  const InstancePlan& ip = plan->instances[0];
  for (const Copy& c : ip.copies) {
    CHECK((c.param != 0 && c.param != 1));  // no bf16 of a or b moves
    const Piece& src = s->sources[c.src_rank].pieces[c.src_piece];
    const Piece& dst = layouts[0][c.dst_rank].pieces[c.dst_piece];
    uint8_t* to = dst.buffer & kStagingBufferBit
                      ? staging[dst.buffer & ~kStagingBufferBit].data()
                      : live.data();
    CopyBoxBetweenPieces(sources[c.src_rank].buffers[src.buffer].data(), src,
                         to, dst, ip.BoxOf(c, layouts[0]),
                         s->model.params[c.param].dtype);
  }
  for (size_t k = 0; k < fallback.size(); ++k) {
    const FallbackTensor& f = fallback[k];
    INFO("staging " << k << ": " << f.name);
    if (!f.quantized()) {
      CHECK(f.name.empty());
      CHECK(std::memcmp(staging[k].data(), t.norm.data(), 512) == 0);
      continue;
    }
    const std::string tensor = t.model.params[f.param].name;
    const Global& g = t.globals.at(tensor);
    if (f.scales) {
      CHECK(f.name == tensor + "_scale_inv");
      REQUIRE(staging[k].size() == g.scales.size() * 4);
      CHECK(std::memcmp(staging[k].data(), g.scales.data(), staging[k].size()) == 0);
    } else {
      CHECK(f.name == tensor);
      CHECK(staging[k] == g.fp8);
    }
  }
  // The live buffer is the loader's to write: untouched here.
  CHECK(std::all_of(live.begin(), live.end(), [](uint8_t x) { return x == 0xEE; }));
}

TEST_CASE("the quantize step's checks refuse when the ranks given do not "
          "hold what the node quantizes, naming the element or the part") {
  Trainer t;
  std::vector<EngineRank> engine;
  std::vector<EngineTable> tables = Fp8Instance(t, 1, &engine);
  absl::StatusOr<ResolvedInstance> r = ResolveDestinationLayout(t.model, tables);
  REQUIRE(r.ok());
  std::vector<std::vector<RankLayout>> layouts = {{r->ranks[0].layout}};
  absl::StatusOr<Fp8Sources> s = AddFp8Sources(t.model, t.ranks, {&*r}, &layouts);
  REQUIRE(s.ok());
  const auto held = HeldPieces(s->quantized, s->sources);
  // b whole on train-0, from ranks 0-2; rank 2 (elements 100003 on) not
  // given.
  std::vector<std::vector<const uint8_t*>> bases;
  for (int k = 0; k < 2; ++k) bases.push_back({t.memory[k].buffers[0].data()});
  absl::Status st = CheckReadable(s->model, s->quantized[1], held[1], bases);
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(st.message()),
             Catch::Contains("quantizing b on train-0: element [195, 163]"));
  // a split: train-1's parts (ranks 3-5) with only rank 4 readable.
  st = CheckPartsReadable(s->model, s->quantized[0], "train-1", held[0],
                          [](const HeldPiece& h) { return h.rank == 4; });
  CHECK(st.code() == absl::StatusCode::kFailedPrecondition);
  CHECK_THAT(std::string(st.message()),
             Catch::Contains("quantizing a on train-1: its part "));
  CHECK(CheckPartsReadable(s->model, s->quantized[0], "train-1", held[0],
                           [](const HeldPiece& h) { return h.rank >= 3; })
            .ok());
}

TEST_CASE("a split tensor's parts: the node with most of it first, a "
          "replica's overlapping piece left out, and pieces that cannot "
          "make disjoint parts refused naming the element") {
  ModelSpec model;
  model.params = {{"w", DType::kBF16, {256, kBlock}}};
  model.BuildIndex();
  EngineRank e;
  e.table.node = "infer-0";
  e.Add("w", DType::kF8E4M3, {256, kBlock}, LoaderKind::kReplicated, {})
      .fp8.scale = "w_scale_inv";
  e.Add("w_scale_inv", DType::kF32, {2, 1}, LoaderKind::kCustom, {});
  e.table.buffer_bytes = {e.next};
  absl::StatusOr<ResolvedInstance> r = ResolveDestinationLayout(model, {e.table});
  REQUIRE(r.ok());
  auto rank = [](int k, const std::string& node, int64_t r0, int64_t n) {
    RankLayout l;
    l.rank = k;
    l.node = node;
    l.pieces.push_back(
        Piece::Contiguous(0, Box{{r0, 0}, {n, kBlock}}, 0, 0, DType::kBF16));
    l.buffer_bytes = {n * kBlock * 2};
    return l;
  };
  std::vector<std::vector<RankLayout>> layouts = {{r->ranks[0].layout}};
  // Two FSDP replicas: train-0 and train-1 hold rows 0-159 and 160-255 of
  // one, train-2 rows 0-99 and train-3 rows 100-255 of the other.
  absl::StatusOr<Fp8Sources> s = AddFp8Sources(
      model,
      {rank(0, "train-0", 0, 160), rank(1, "train-1", 160, 96),
       rank(2, "train-2", 0, 100), rank(3, "train-3", 100, 156)},
      {&*r}, &layouts);
  INFO(s.status());
  REQUIRE(s.ok());
  const QuantizedParam& q = s->quantized[0];
  CHECK(q.node == "train-0");
  REQUIRE(q.parts.size() == 2);
  CHECK(q.parts[0].node == "train-0");
  CHECK(q.parts[0].box == Box{{0, 0}, {160, kBlock}});
  // train-3 holds more than train-1, but its piece overlaps train-0's.
  CHECK(q.parts[1].node == "train-1");
  CHECK(q.parts[1].box == Box{{160, 0}, {96, kBlock}});
  // Only replicas cut across nodes differently: train-0 rows 0-159 and
  // train-3 rows 100-255 overlap, so rows 160-255 are in no part.
  layouts = {{r->ranks[0].layout}};
  s = AddFp8Sources(
      model, {rank(0, "train-0", 0, 160), rank(1, "train-3", 100, 156)},
      {&*r}, &layouts);
  CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.status().message()),
             Catch::Contains("checkpoint parameter w is quantized in flight") &&
                 Catch::Contains("element [160, 0] is in none"));
}

TEST_CASE("DP replicas on different nodes share the quantizing: each tensor "
          "goes to the replica node with the least to quantize so far") {
  ModelSpec model;
  for (int i = 0; i < 4; ++i) {
    model.params.push_back(
        {"w" + std::to_string(i), DType::kBF16, {kBlock, kBlock}});
  }
  model.BuildIndex();
  // Two DP replicas, each holding every tensor whole.
  std::vector<RankLayout> trainer(2);
  for (int r = 0; r < 2; ++r) {
    trainer[r].rank = r;
    trainer[r].node = "train-" + std::to_string(r);
    for (int i = 0; i < 4; ++i) {
      trainer[r].pieces.push_back(Piece::Contiguous(
          i, FullBox({kBlock, kBlock}), 0, i * kBlock * kBlock * 2,
          DType::kBF16));
    }
  }
  EngineRank e;
  e.table.node = "infer-0";
  for (int i = 0; i < 4; ++i) {
    const std::string w = "w" + std::to_string(i);
    e.Add(w, DType::kF8E4M3, {kBlock, kBlock}, LoaderKind::kReplicated, {})
        .fp8.scale = w + "_scale_inv";
    e.Add(w + "_scale_inv", DType::kF32, {1, 1}, LoaderKind::kCustom, {});
  }
  e.table.buffer_bytes = {e.next};
  absl::StatusOr<ResolvedInstance> r =
      ResolveDestinationLayout(model, {e.table});
  INFO(r.status().message());
  REQUIRE(r.ok());
  std::vector<std::vector<RankLayout>> layouts = {{r->ranks[0].layout}};
  absl::StatusOr<Fp8Sources> s = AddFp8Sources(model, trainer, {&*r}, &layouts);
  REQUIRE(s.ok());
  REQUIRE(s->quantized.size() == 4);
  std::map<std::string, int> per_node;
  for (const QuantizedParam& q : s->quantized) ++per_node[q.node];
  CHECK(per_node == std::map<std::string, int>{{"train-0", 2}, {"train-1", 2}});
  CHECK(s->sources.size() == 4);  // two trainer ranks, two quantizer ranks
}

}  // namespace
}  // namespace ferry
