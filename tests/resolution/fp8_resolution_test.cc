// FP8 in flight, layout resolution (issue 40): an engine that serves FP8
// with 128x128 block scales declares its weights quantized from the
// trainer's bf16 checkpoint; resolution places whole blocks.
//
// The oracle is what an FP8 engine's own loader holds after loading a
// checkpoint quantized whole: every bf16 checkpoint tensor quantized with
// the rule written from its definition (tests/core/fp8_oracle.h, not the
// product's routine), then narrowed and concatenated as vLLM's block-FP8
// loaders do (weight rows and their scale rows alike). The test executes
// the resolved targets the way the data path will: each box of the bf16
// tensor quantized on its own by the product's QuantizeBlocks and written
// at the target's offsets and strides. Every live byte of every weight and
// scale tensor must then be the oracle's, written exactly once. That a box
// quantized alone equals the full tensor's quantization is the point: the
// boxes are whole blocks.
#include <catch2/catch.hpp>

#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/fp8_blocks.h"
#include "core/layout_resolution.h"
#include "tests/core/fp8_oracle.h"

namespace ferry {
namespace {

using fp8_oracle::Bf16;
using fp8_oracle::ToBf16Truncated;

// A row-major tensor of `unit` bytes per element.
struct Bytes {
  Dims shape;
  int64_t unit = 1;
  std::vector<uint8_t> data;
};

int64_t Count(const Dims& d) {
  int64_t n = 1;
  for (int64_t x : d) n *= x;
  return n;
}

// torch.narrow along dim 0 or 1 of a 2-D tensor.
Bytes Narrow(const Bytes& t, size_t dim, int64_t start, int64_t len) {
  REQUIRE(t.shape.size() == 2);
  REQUIRE(start + len <= t.shape[dim]);
  Bytes out{t.shape, t.unit, {}};
  out.shape[dim] = len;
  for (int64_t r = 0; r < out.shape[0]; ++r) {
    const int64_t sr = dim == 0 ? start + r : r;
    const int64_t sc = dim == 1 ? start : 0;
    const uint8_t* row = t.data.data() + (sr * t.shape[1] + sc) * t.unit;
    out.data.insert(out.data.end(), row, row + out.shape[1] * t.unit);
  }
  return out;
}

// torch.cat along dim 0.
Bytes CatRows(const std::vector<Bytes>& ts) {
  Bytes out{ts[0].shape, ts[0].unit, {}};
  out.shape[0] = 0;
  for (const Bytes& t : ts) {
    out.shape[0] += t.shape[0];
    out.data.insert(out.data.end(), t.data.begin(), t.data.end());
  }
  return out;
}

// A checkpoint tensor in bf16 and its quantization by the oracle.
struct Checkpoint {
  Dims shape;
  std::vector<uint16_t> bf16;
  Bytes weight;  // fp8 bytes
  Bytes scale;   // float32 per 128x128 block
};

constexpr int64_t kBlock = 128;

Checkpoint Quantized(const Dims& shape, uint32_t seed, DType fp8) {
  Checkpoint c;
  c.shape = shape;
  c.bf16.resize(Count(shape));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  for (uint16_t& v : c.bf16) v = ToBf16Truncated(normal(rng));
  // Outliers, zeros and a negative zero, so blocks differ in scale.
  c.bf16[0] = ToBf16Truncated(7.5f);
  c.bf16[c.bf16.size() / 2] = 0x8000;
  c.bf16.back() = ToBf16Truncated(-3.0f);
  const Fp8BlockShape blocks{shape[0], shape[1], kBlock, kBlock};
  const bool e4m3 = fp8 == DType::kF8E4M3;
  std::vector<float> scales;
  fp8_oracle::OracleBlocks(c.bf16, blocks,
                           e4m3 ? fp8_oracle::kE4M3Spec : fp8_oracle::kE5M2Spec,
                           Fp8Max(fp8), &c.weight.data, &scales);
  c.weight.shape = shape;
  c.weight.unit = 1;
  c.scale.shape = {blocks.block_grid_rows(), blocks.block_grid_cols()};
  c.scale.unit = 4;
  c.scale.data.resize(scales.size() * 4);
  std::memcpy(c.scale.data.data(), scales.data(), c.scale.data.size());
  return c;
}

// The model: a GQA attention block (4 q heads and 1 kv head of 128), an
// MLP, 2 experts of 256 rows, and a router whose 300 rows end in a short
// block. All bf16; dims in multiples of 128 but where a test says.
struct Model {
  ModelSpec spec;
  std::map<std::string, Checkpoint> tensors;

  void Add(const std::string& name, Dims shape, DType fp8) {
    spec.params.push_back({name, DType::kBF16, shape});
    tensors[name] = Quantized(shape, static_cast<uint32_t>(tensors.size() + 7),
                              fp8);
  }
  const Checkpoint& operator[](const std::string& name) const {
    INFO(name);
    REQUIRE(tensors.count(name) == 1);
    return tensors.at(name);
  }
};

const std::string kAttn = "model.layers.0.self_attn.";
const std::string kMlp = "model.layers.0.mlp.";
const std::string kMoe = "model.layers.1.mlp.";

std::string ExpertName(int e, const std::string& proj) {
  return kMoe + "experts." + std::to_string(e) + "." + proj + ".weight";
}

Model DeepSeekLike(DType fp8) {
  Model m;
  m.Add(kAttn + "q_proj.weight", {512, 256}, fp8);
  m.Add(kAttn + "k_proj.weight", {128, 256}, fp8);
  m.Add(kAttn + "v_proj.weight", {128, 256}, fp8);
  m.Add(kAttn + "o_proj.weight", {256, 512}, fp8);
  m.Add(kMlp + "gate_proj.weight", {512, 256}, fp8);
  m.Add(kMlp + "up_proj.weight", {512, 256}, fp8);
  m.Add(kMlp + "down_proj.weight", {256, 512}, fp8);
  m.Add(kMoe + "gate.weight", {300, 200}, fp8);
  for (int e = 0; e < 2; ++e) {
    m.Add(ExpertName(e, "gate_proj"), {256, 256}, fp8);
    m.Add(ExpertName(e, "up_proj"), {256, 256}, fp8);
  }
  m.spec.BuildIndex();
  return m;
}

// What the engine's loader holds: the live weight and its scales.
struct Live {
  Bytes weight;
  Bytes scale;
};

// One rank's table: every FP8 weight followed by its scale tensor, laid
// out one after another in buffer 0, with the oracle's live tensors.
class RankTable {
 public:
  RankTable(int32_t rank, int32_t tp, DType fp8) : fp8_(fp8) {
    table_.tp_rank = rank;
    table_.tp_size = tp;
    table_.node = "node-e";
  }

  // An FP8 weight `name` of `local` shape and its scales; the reference is
  // valid until the next call.
  EngineParam& Add(const std::string& name, LoaderKind loader, Dims local,
                   Live expected) {
    EngineParam w = Param(name, fp8_, local);
    w.loader = loader;
    w.fp8.scale = name + "_scale_inv";
    EngineParam s = Param(w.fp8.scale, DType::kF32,
                          Fp8ScaleShape(local, kBlock, kBlock));
    s.loader = LoaderKind::kCustom;  // what vLLM's block-FP8 scales declare
    expected_[w.name] = std::move(expected.weight);
    expected_[s.name] = std::move(expected.scale);
    table_.params.push_back(std::move(s));
    table_.params.push_back(std::move(w));
    return table_.params.back();
  }

  EngineTable Finish() {
    table_.buffer_bytes = {next_};
    return table_;
  }
  const std::map<std::string, Bytes>& expected() const { return expected_; }

 private:
  EngineParam Param(const std::string& name, DType dtype, const Dims& local) {
    EngineParam p;
    p.name = name;
    p.dtype = dtype;
    p.local_shape = local;
    p.tp_size = table_.tp_size;
    p.buffer = 0;
    p.byte_offset = next_;
    next_ += (Count(local) * UnitBytes(dtype) + 63) / 64 * 64 + 64;
    return p;
  }

  const DType fp8_;
  EngineTable table_;
  std::map<std::string, Bytes> expected_;
  int64_t next_ = 0;
};

Live Shard(const Checkpoint& c, size_t dim, int tp, int rank) {
  const int64_t len = c.shape[dim] / tp;
  REQUIRE(len % kBlock == 0);
  return {Narrow(c.weight, dim, rank * len, len),
          Narrow(c.scale, dim, rank * len / kBlock, len / kBlock)};
}

Live Whole(const Checkpoint& c) { return {c.weight, c.scale}; }

Live Cat(const std::vector<Live>& parts) {
  std::vector<Bytes> w, s;
  for (const Live& p : parts) {
    w.push_back(p.weight);
    s.push_back(p.scale);
  }
  return {CatRows(w), CatRows(s)};
}

// vLLM's tables for a `tp`-way instance. `moe`: include the experts' w13
// (3-D, {expert, rows, cols}); at TP 4 their 64-row shards cut blocks.
std::vector<RankTable> Tables(const Model& m, int tp, DType fp8, bool moe) {
  std::vector<RankTable> out;
  for (int r = 0; r < tp; ++r) {
    RankTable t(r, tp, fp8);
    // qkv: q split, the one kv head replicated on every rank.
    EngineParam& qkv =
        t.Add(kAttn + "qkv_proj.weight", LoaderKind::kFused,
              {512 / tp + 2 * 128, 256},
              Cat({Shard(m[kAttn + "q_proj.weight"], 0, tp, r),
                   Whole(m[kAttn + "k_proj.weight"]),
                   Whole(m[kAttn + "v_proj.weight"])}));
    qkv.shard_dim = 0;
    qkv.parts = {{kAttn + "q_proj.weight", {}},
                 {kAttn + "k_proj.weight", {}, 128},
                 {kAttn + "v_proj.weight", {}, 128}};
    t.Add(kAttn + "o_proj.weight", LoaderKind::kRow, {256, 512 / tp},
          Shard(m[kAttn + "o_proj.weight"], 1, tp, r))
        .shard_dim = 1;
    EngineParam& gate_up =
        t.Add(kMlp + "gate_up_proj.weight", LoaderKind::kFused,
              {2 * 512 / tp, 256},
              Cat({Shard(m[kMlp + "gate_proj.weight"], 0, tp, r),
                   Shard(m[kMlp + "up_proj.weight"], 0, tp, r)}));
    gate_up.shard_dim = 0;
    gate_up.parts = {{kMlp + "gate_proj.weight", {}},
                     {kMlp + "up_proj.weight", {}}};
    t.Add(kMlp + "down_proj.weight", LoaderKind::kRow, {256, 512 / tp},
          Shard(m[kMlp + "down_proj.weight"], 1, tp, r))
        .shard_dim = 1;
    t.Add(kMoe + "gate.weight", LoaderKind::kReplicated, {300, 200},
          Whole(m[kMoe + "gate.weight"]));
    if (moe) {
      // {expert, gate rows + up rows, cols}; the live tensor of the oracle
      // is the experts' Cat one after another (expert-major).
      const int64_t rows = 256 / tp;
      std::vector<Live> experts;
      FusedParts parts;
      std::vector<FusedPart> list;
      for (int e = 0; e < 2; ++e) {
        if (rows % kBlock == 0) {
          experts.push_back(Cat({Shard(m[ExpertName(e, "gate_proj")], 0, tp, r),
                                 Shard(m[ExpertName(e, "up_proj")], 0, tp, r)}));
        }
        list.push_back({ExpertName(e, "gate_proj"), {e}});
        list.push_back({ExpertName(e, "up_proj"), {e}});
      }
      Live expected = experts.empty() ? Live{} : Cat(experts);
      expected.weight.shape = {2, 2 * rows, 256};
      expected.scale.shape = Fp8ScaleShape({2, 2 * rows, 256}, kBlock, kBlock);
      EngineParam& w13 = t.Add(kMoe + "experts.w13_weight", LoaderKind::kFused,
                               {2, 2 * rows, 256}, expected);
      w13.shard_dim = 0;
      w13.parts = FusedParts(std::move(list));
    }
    out.push_back(std::move(t));
  }
  return out;
}

std::vector<EngineTable> Finished(std::vector<RankTable>& ranks) {
  std::vector<EngineTable> out;
  for (RankTable& r : ranks) out.push_back(r.Finish());
  return out;
}

// Runs the targets as the data path will: each box quantized on its own
// (the product's routine) and scattered to the live weight and scales.
// Returns the rank's buffer and how often each byte was written.
struct Written {
  std::vector<uint8_t> buffer;
  std::vector<int> times;
};

Written Execute(const Model& m, const EngineTable& table,
                const ResolvedRank& rank) {
  Written out;
  out.buffer.assign(table.buffer_bytes[0], 0xEE);
  out.times.assign(table.buffer_bytes[0], 0);
  for (const QuantizedTarget& t : rank.quantized) {
    REQUIRE(t.weight_buffer == 0);
    REQUIRE(t.scale_buffer == 0);
    const Checkpoint& c = m[m.spec.params[t.param].name];
    REQUIRE(t.box.rank() == 2);
    const int64_t rows = t.box.extent[0], cols = t.box.extent[1];
    std::vector<uint16_t> box(rows * cols);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols; ++k) {
        box[r * cols + k] = c.bf16[(t.box.offset[0] + r) * c.shape[1] +
                                   t.box.offset[1] + k];
      }
    }
    const Fp8BlockShape shape{rows, cols, t.block_rows, t.block_cols};
    std::vector<uint8_t> fp8(rows * cols);
    std::vector<float> scales(shape.block_grid_rows() * shape.block_grid_cols());
    REQUIRE(QuantizeBlocks(box.data(), DType::kBF16, shape, t.format,
                           fp8.data(), scales.data())
                .ok());
    const Box blocks = t.ScaleBox();
    REQUIRE(blocks.extent[0] == shape.block_grid_rows());
    REQUIRE(blocks.extent[1] == shape.block_grid_cols());
    const int64_t size = static_cast<int64_t>(out.buffer.size());
    int64_t outside = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 0; k < cols; ++k) {
        const int64_t at =
            t.weight_offset + r * t.weight_strides[0] + k * t.weight_strides[1];
        if (at < 0 || at >= size) {
          ++outside;
          continue;
        }
        out.buffer[at] = fp8[r * cols + k];
        ++out.times[at];
      }
    }
    for (int64_t r = 0; r < blocks.extent[0]; ++r) {
      for (int64_t k = 0; k < blocks.extent[1]; ++k) {
        const int64_t at = t.scale_offset +
                           4 * (r * t.scale_strides[0] + k * t.scale_strides[1]);
        if (at < 0 || at + 4 > size) {
          ++outside;
          continue;
        }
        std::memcpy(&out.buffer[at], &scales[r * blocks.extent[1] + k], 4);
        for (int b = 0; b < 4; ++b) ++out.times[at + b];
      }
    }
    CHECK(outside == 0);
  }
  return out;
}

const ParamDecision& DecisionOf(const ResolvedRank& rank,
                                const std::string& name) {
  for (const ParamDecision& d : rank.decisions) {
    if (d.engine_name == name) return d;
  }
  FAIL("no decision for " << name);
  return rank.decisions[0];
}

TEST_CASE("FP8 weights from a bf16 checkpoint resolve quantized, and the "
          "boxes quantized one by one are the whole tensor's quantization, "
          "narrowed as vLLM's loaders narrow it") {
  for (DType fp8 : {DType::kF8E4M3, DType::kF8E5M2}) {
    const Model m = DeepSeekLike(fp8);
    for (int tp : {1, 2, 4}) {
      INFO("tp " << tp << ", " << DTypeName(fp8));
      const bool moe = tp <= 2;  // at TP 4 the experts' shards cut blocks
      std::vector<RankTable> ranks = Tables(m, tp, fp8, moe);
      const std::vector<EngineTable> tables = Finished(ranks);
      absl::StatusOr<ResolvedInstance> res =
          ResolveDestinationLayout(m.spec, tables);
      INFO(res.status());
      REQUIRE(res.ok());
      for (int r = 0; r < tp; ++r) {
        INFO("rank " << r);
        const ResolvedRank& rank = res->ranks[r];
        CHECK(rank.layout.pieces.empty());  // no byte copies, no staging
        CHECK(rank.fallback.empty());
        for (const ParamDecision& d : rank.decisions) {
          INFO(d.engine_name << ": " << d.reason);
          CHECK(d.resolution == Resolution::kQuantized);
        }
        const ParamDecision& qkv =
            DecisionOf(rank, kAttn + "qkv_proj.weight");
        CHECK_THAT(qkv.reason, Catch::StartsWith(absl::StrCat(
                                   "quantized: bf16 -> fp8 ",
                                   fp8 == DType::kF8E4M3 ? "e4m3" : "e5m2",
                                   ", 128x128 blocks; fused along dim 0")));
        CHECK(qkv.checkpoint_params.size() == 3);
        const ParamDecision& scale =
            DecisionOf(rank, kAttn + "qkv_proj.weight_scale_inv");
        CHECK(scale.reason ==
              "quantized: the block scales of " + kAttn + "qkv_proj.weight");
        CHECK(scale.checkpoint_params.empty());

        const Written w = Execute(m, tables[r], rank);
        for (const EngineParam& p : tables[r].params) {
          INFO(p.name);
          const Bytes& want = ranks[r].expected().at(p.name);
          const int64_t n = Count(p.local_shape) * UnitBytes(p.dtype);
          REQUIRE(static_cast<int64_t>(want.data.size()) == n);
          int64_t wrong = 0, not_once = 0;
          for (int64_t i = 0; i < n; ++i) {
            wrong += w.buffer[p.byte_offset + i] != want.data[i];
            not_once += w.times[p.byte_offset + i] != 1;
          }
          CHECK(wrong == 0);
          CHECK(not_once == 0);
        }
      }
    }
  }
}

// One parameter table of a TP `tp` instance holding only `name`: an FP8
// weight (column-parallel over dim 0) with its scales.
std::vector<EngineTable> OneWeight(const Model& m, const std::string& name,
                                   int tp, Dims local, LoaderKind loader,
                                   const std::function<void(EngineTable&)>&
                                       edit = {}) {
  std::vector<EngineTable> out;
  for (int r = 0; r < tp; ++r) {
    RankTable t(r, tp, DType::kF8E4M3);
    t.Add(name, loader, local, Live{}).shard_dim = 0;
    EngineTable table = t.Finish();
    if (edit) edit(table);
    out.push_back(std::move(table));
  }
  (void)m;
  return out;
}

EngineParam& Named(EngineTable& t, const std::string& name) {
  for (EngineParam& p : t.params) {
    if (p.name == name) return p;
  }
  FAIL("no parameter " << name);
  return t.params[0];
}

TEST_CASE("FP8 declarations that cannot be honoured are INVALID_ARGUMENT "
          "naming the parameter and rank") {
  Model m = DeepSeekLike(DType::kF8E4M3);
  m.spec.params.push_back({"model.layers.0.int_table.weight", DType::kI32,
                           {256, 256}});
  m.spec.params.push_back({"model.layers.0.odd.weight", DType::kBF16,
                           {384, 256}});
  m.spec.BuildIndex();
  const std::string q = kAttn + "q_proj.weight";
  auto refused = [&](const std::vector<EngineTable>& tables,
                     const std::vector<std::string>& says) {
    absl::StatusOr<ResolvedInstance> res =
        ResolveDestinationLayout(m.spec, tables);
    REQUIRE_FALSE(res.ok());
    INFO(res.status());
    CHECK(res.status().code() == absl::StatusCode::kInvalidArgument);
    for (const std::string& s : says) {
      CHECK_THAT(std::string(res.status().message()), Catch::Contains(s));
    }
  };

  SECTION("a block size that does not divide the live shard: 384 rows at "
          "TP 2 are 192-row shards; rank 1's starts at row 192") {
    refused(OneWeight(m, "model.layers.0.odd.weight", 2, {192, 256},
                      LoaderKind::kColumn),
            {"model.layers.0.odd.weight", "rank 0", "rows 0:192",
             "cut 128x128 blocks"});
  }
  SECTION("the experts' 64-row shards at TP 4") {
    std::vector<RankTable> ranks = Tables(m, 4, DType::kF8E4M3, true);
    refused(Finished(ranks), {kMoe + "experts.w13_weight", "rank 0",
                              "rows 0:64", "cut 128x128 blocks"});
  }
  SECTION("a scale tensor of the wrong shape") {
    refused(OneWeight(m, q, 2, {256, 256}, LoaderKind::kColumn,
                      [&](EngineTable& t) {
                        Named(t, q + "_scale_inv").local_shape = {2, 1};
                      }),
            {q, "tp rank 0", "has shape [2, 1]", "need [2, 2]"});
  }
  SECTION("a scale tensor of the wrong dtype") {
    refused(OneWeight(m, q, 2, {256, 256}, LoaderKind::kColumn,
                      [&](EngineTable& t) {
                        Named(t, q + "_scale_inv").dtype = DType::kBF16;
                      }),
            {q, "is bf16; block scales are f32"});
  }
  SECTION("a scale tensor the rank does not have") {
    refused(OneWeight(m, q, 1, {512, 256}, LoaderKind::kColumn,
                      [&](EngineTable& t) {
                        Named(t, q).fp8.scale = "nowhere";
                      }),
            {q, "nowhere is no engine parameter of the rank"});
  }
  SECTION("a weight declared FP8 whose dtype is not") {
    refused(OneWeight(m, q, 1, {512, 256}, LoaderKind::kColumn,
                      [&](EngineTable& t) {
                        Named(t, q).dtype = DType::kBF16;
                      }),
            {q, "its dtype is bf16"});
  }
  SECTION("e4m3 for a parameter the trainer sends as int") {
    refused(OneWeight(m, "model.layers.0.int_table.weight", 1, {256, 256},
                      LoaderKind::kReplicated),
            {"model.layers.0.int_table.weight", "is i32",
             "quantizes bf16, f16 or f32"});
  }
  SECTION("a loader ferry cannot reproduce that consumes two checkpoint "
          "parameters: a quantized fallback takes one") {
    refused(OneWeight(m, q, 1, {512, 256}, LoaderKind::kCustom,
                      [&](EngineTable& t) {
                        Named(t, q).consumes = {q, kAttn + "k_proj.weight"};
                      }),
            {q, "on rank 0", "goes through the engine's loader quantized",
             "consumes 2"});
  }
}

// The quantized fallback of FP8 weight q (512 x 256, one rank): two
// staging tensors, its FP8 elements under q's name and its scales under
// the declared scale tensor's, and no placed targets.
void ExpectThroughLoader(const ResolvedInstance& res, const std::string& q,
                         const std::string& why) {
  const ResolvedRank& r = res.ranks[0];
  CHECK(r.quantized.empty());
  REQUIRE(r.fallback.size() >= 2);
  int found = 0;
  for (const FallbackTensor& f : r.fallback) {
    if (!f.quantized()) continue;
    ++found;
    CHECK(f.format == DType::kF8E4M3);
    CHECK(f.block_rows == 128);
    CHECK(f.block_cols == 128);
    CHECK(f.name == (f.scales ? q + "_scale_inv" : q));
    CHECK(f.staging_buffer & kStagingBufferBit);
  }
  CHECK(found == 2);
  for (const ParamDecision& d : r.decisions) {
    if (d.engine_name != q) continue;
    CHECK(d.resolution == Resolution::kQuantized);
    CHECK_THAT(d.reason,
               Catch::StartsWith("quantized, through the engine's loader: "
                                 "bf16 -> fp8 e4m3, 128x128 blocks, the "
                                 "whole tensor (") &&
                   Catch::Contains(why));
  }
}

TEST_CASE("an FP8 weight whose loader must run goes through it quantized: "
          "its loader transforms it, its module falls back for another "
          "parameter, or load_format is fallback_only") {
  Model m = DeepSeekLike(DType::kF8E4M3);
  const std::string q = kAttn + "q_proj.weight";
  SECTION("a loader that transforms it (MLA's kv_b_proj)") {
    std::vector<EngineTable> tables = OneWeight(
        m, q, 1, {512, 256}, LoaderKind::kColumn,
        [&](EngineTable& t) { Named(t, q).flags |= kFlagTransformed; });
    absl::StatusOr<ResolvedInstance> res =
        ResolveDestinationLayout(m.spec, tables);
    INFO(res.status());
    REQUIRE(res.ok());
    ExpectThroughLoader(*res, q, "transform");
    // FallbackSpec: what staging holds and the loader is handed.
    for (const FallbackTensor& f : res->ranks[0].fallback) {
      const ParamSpec s = FallbackSpec(m.spec, f);
      CHECK(s.name == f.name);
      CHECK(s.dtype == (f.scales ? DType::kF32 : DType::kF8E4M3));
      CHECK(s.shape == (f.scales ? Dims{4, 2} : Dims{512, 256}));
    }
    // direct_only refuses what needs the engine's loader.
    res = ResolveDestinationLayout(m.spec, tables, LoadFormat::kDirectOnly);
    CHECK(res.status().code() == absl::StatusCode::kFailedPrecondition);
    CHECK_THAT(std::string(res.status().message()),
               Catch::Contains("direct_only") && Catch::Contains(q));
  }
  SECTION("its module falls back for a bias only the loader can take") {
    m.spec.params.push_back({kAttn + "q_proj.bias", DType::kBF16, {512}});
    m.spec.BuildIndex();
    std::vector<EngineTable> tables = OneWeight(
        m, q, 1, {512, 256}, LoaderKind::kColumn, [&](EngineTable& t) {
          EngineParam bias;
          bias.name = kAttn + "q_proj.bias";
          bias.dtype = DType::kBF16;
          bias.local_shape = {512};
          bias.loader = LoaderKind::kCustom;
          bias.byte_offset = t.buffer_bytes[0];
          t.buffer_bytes[0] += 1024;
          t.params.push_back(bias);
        });
    absl::StatusOr<ResolvedInstance> res =
        ResolveDestinationLayout(m.spec, tables);
    INFO(res.status());
    REQUIRE(res.ok());
    ExpectThroughLoader(*res, q,
                        "falls back: " + kAttn + "q_proj.bias on tp rank 0");
  }
  SECTION("load_format fallback_only") {
    std::vector<EngineTable> tables =
        OneWeight(m, q, 1, {512, 256}, LoaderKind::kColumn);
    absl::StatusOr<ResolvedInstance> res =
        ResolveDestinationLayout(m.spec, tables, LoadFormat::kFallbackOnly);
    INFO(res.status());
    REQUIRE(res.ok());
    ExpectThroughLoader(*res, q, "load_format is fallback_only");
    // direct_only: quantized in place is not a fallback.
    res = ResolveDestinationLayout(m.spec, tables, LoadFormat::kDirectOnly);
    INFO(res.status());
    CHECK(res.ok());
  }
}

}  // namespace
}  // namespace ferry
