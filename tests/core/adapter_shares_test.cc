// Adapter shares against vLLM's own slicing of LoRA weights
// (MergedQKVParallelLinearWithLoRA, ColumnParallelLinearWithLoRA,
// RowParallelLinearWithLoRA: slice_lora_a / slice_lora_b), restated as row
// and column ranges. The base layout comes from resolving real engine
// tables (fused qkv with GQA kv heads replicated at TP 4, row-parallel
// o_proj and down_proj), so the shares follow from the layout the daemon
// plans, not from names.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "core/adapter_shares.h"
#include "core/layout_resolution.h"

namespace ferry {
namespace {

constexpr int64_t kHidden = 64, kHeadDim = 8, kKvHeads = 2, kInter = 128;
constexpr int64_t kQ = 64, kKv = kKvHeads * kHeadDim;  // 64 and 16 rows

const std::string kL = "model.layers.0.";

ModelSpec BaseModel() {
  ModelSpec m;
  auto add = [&](const std::string& n, Dims shape) {
    m.params.push_back({kL + n, DType::kBF16, std::move(shape)});
  };
  add("self_attn.q_proj.weight", {kQ, kHidden});
  add("self_attn.k_proj.weight", {kKv, kHidden});
  add("self_attn.v_proj.weight", {kKv, kHidden});
  add("self_attn.o_proj.weight", {kHidden, kQ});
  add("mlp.gate_proj.weight", {kInter, kHidden});
  add("mlp.up_proj.weight", {kInter, kHidden});
  add("mlp.down_proj.weight", {kHidden, kInter});
  m.BuildIndex();
  return m;
}

// vLLM's table of one TP rank: qkv_proj and gate_up_proj fused, o_proj and
// down_proj row-parallel. `o_custom`: o_proj's loader is unknown (falls
// back: the engine loads it whole).
EngineTable Table(int tp, int rank, bool o_custom = false) {
  EngineTable t;
  t.tp_rank = rank;
  t.tp_size = tp;
  int64_t offset = 0;
  auto add = [&](EngineParam p) {
    p.dtype = DType::kBF16;
    p.tp_size = tp;
    p.byte_offset = offset;
    offset += Volume(p.local_shape) * 2;
    t.params.push_back(std::move(p));
  };
  const int64_t kv_rows = std::max<int64_t>(kKv / tp, kHeadDim);
  EngineParam qkv;
  qkv.name = kL + "self_attn.qkv_proj.weight";
  qkv.loader = LoaderKind::kFused;
  qkv.local_shape = {kQ / tp + 2 * kv_rows, kHidden};
  qkv.parts = {{kL + "self_attn.q_proj.weight", {}, 0},
               {kL + "self_attn.k_proj.weight", {}, kv_rows},
               {kL + "self_attn.v_proj.weight", {}, kv_rows}};
  add(qkv);
  EngineParam o;
  o.name = kL + "self_attn.o_proj.weight";
  o.loader = o_custom ? LoaderKind::kCustom : LoaderKind::kRow;
  o.shard_dim = 1;
  o.local_shape = {kHidden, kQ / tp};
  add(o);
  EngineParam gu;
  gu.name = kL + "mlp.gate_up_proj.weight";
  gu.loader = LoaderKind::kFused;
  gu.local_shape = {2 * kInter / tp, kHidden};
  gu.parts = {{kL + "mlp.gate_proj.weight", {}, 0},
              {kL + "mlp.up_proj.weight", {}, 0}};
  add(gu);
  EngineParam down;
  down.name = kL + "mlp.down_proj.weight";
  down.loader = LoaderKind::kRow;
  down.shard_dim = 1;
  down.local_shape = {kHidden, kInter / tp};
  add(down);
  t.buffer_bytes = {offset};
  return t;
}

std::vector<RankLayout> Layouts(const ModelSpec& m, int tp,
                                bool o_custom = false) {
  std::vector<EngineTable> tables;
  for (int r = 0; r < tp; ++r) tables.push_back(Table(tp, r, o_custom));
  absl::StatusOr<ResolvedInstance> resolved =
      ResolveDestinationLayout(m, tables);
  REQUIRE(resolved.ok());
  std::vector<RankLayout> out;
  for (const ResolvedRank& r : resolved->ranks) out.push_back(r.layout);
  return out;
}

std::vector<ParamSpec> Adapter(int64_t r,
                               const std::vector<std::string>& modules) {
  std::vector<ParamSpec> a;
  for (const std::string& m : modules) {
    const ModelSpec base = BaseModel();
    const Dims& w = base.params[base.Find(kL + m + ".weight")].shape;
    a.push_back({"base_model.model." + kL + m + ".lora_A.weight",
                 DType::kF32, {r, w[1]}});
    a.push_back({"base_model.model." + kL + m + ".lora_B.weight",
                 DType::kF32, {w[0], r}});
  }
  return a;
}

Box Rows(int64_t begin, int64_t end, int64_t cols) {
  return Box{{begin, 0}, {end - begin, cols}};
}
Box Cols(int64_t rows, int64_t begin, int64_t end) {
  return Box{{0, begin}, {rows, end - begin}};
}

TEST_CASE("Shares follow vLLM's LoRA slicing at tp 1, 2 and 4") {
  const ModelSpec base = BaseModel();
  const int64_t r = 4;
  const std::vector<std::string> modules = {
      "self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj",
      "mlp.up_proj", "mlp.down_proj"};
  const std::vector<ParamSpec> adapter = Adapter(r, modules);
  for (int tp : {1, 2, 4}) {
    absl::StatusOr<AdapterSharePlan> plan =
        PlanAdapterShares("sql", adapter, base, Layouts(base, tp), {});
    REQUIRE(plan.ok());
    CHECK(plan->rank == r);
    REQUIRE(plan->ranks.size() == static_cast<size_t>(tp));
    for (int k = 0; k < tp; ++k) {
      INFO("tp " << tp << " rank " << k);
      const auto& s = plan->ranks[k];
      REQUIRE(s.size() == adapter.size());
      // Column-parallel parts: lora_A whole, lora_B's rows of the rank.
      CHECK(s[0].box == Cols(r, 0, kHidden));  // q lora_A
      CHECK(s[1].box == Rows(k * kQ / tp, (k + 1) * kQ / tp, r));
      // v with 2 kv heads: at tp 4 each head is replicated on 2 ranks
      // (vLLM: kv_shard_id = tp_rank // num_kv_head_replicas).
      const int64_t replicas = std::max<int64_t>(1, tp / kKvHeads);
      const int64_t kv_len = kKv * replicas / tp;
      const int64_t kv_shard = k / replicas;
      CHECK(s[2].box == Cols(r, 0, kHidden));
      CHECK(s[3].box ==
            Rows(kv_shard * kv_len, (kv_shard + 1) * kv_len, r));
      // Row-parallel: lora_A's columns of the rank, lora_B whole.
      CHECK(s[4].box == Cols(r, k * kQ / tp, (k + 1) * kQ / tp));
      CHECK(s[5].box == Rows(0, kHidden, r));
      CHECK(s[6].box == Cols(r, 0, kHidden));  // up lora_A
      CHECK(s[7].box == Rows(k * kInter / tp, (k + 1) * kInter / tp, r));
      CHECK(s[8].box == Cols(r, k * kInter / tp, (k + 1) * kInter / tp));
      CHECK(s[9].box == Rows(0, kHidden, r));
      for (const AdapterShare& one : s) CHECK_FALSE(one.whole);
    }
  }
}

TEST_CASE("A base layer the engine loads itself gets whole adapter tensors") {
  const ModelSpec base = BaseModel();
  const std::vector<ParamSpec> adapter =
      Adapter(4, {"self_attn.q_proj", "self_attn.o_proj"});
  absl::StatusOr<AdapterSharePlan> plan = PlanAdapterShares(
      "sql", adapter, base, Layouts(base, 2, /*o_custom=*/true), {});
  REQUIRE(plan.ok());
  for (int k = 0; k < 2; ++k) {
    const auto& s = plan->ranks[k];
    CHECK_FALSE(s[1].whole);  // q lora_B: still the rank's rows
    CHECK(s[1].box == Rows(k * 32, (k + 1) * 32, 4));
    CHECK(s[2].whole);
    CHECK(s[2].box == Cols(4, 0, kQ));
    CHECK(s[3].whole);
    CHECK(s[3].box == Rows(0, kHidden, 4));
  }
}

TEST_CASE("PEFT names with and without prefix and adapter name") {
  std::string module;
  bool is_a = false;
  CHECK(ParseLoraName("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight",
                      &module, &is_a));
  CHECK(module == "model.layers.3.mlp.up_proj");
  CHECK_FALSE(is_a);
  CHECK(ParseLoraName("model.layers.3.self_attn.q_proj.lora_A.default.weight",
                      &module, &is_a));
  CHECK(module == "model.layers.3.self_attn.q_proj");
  CHECK(is_a);
  CHECK_FALSE(ParseLoraName("model.layers.3.mlp.up_proj.weight", &module,
                            &is_a));
  CHECK_FALSE(ParseLoraName("lora_A.weight", &module, &is_a));
  CHECK_FALSE(ParseLoraName("x.lora_A.a.b.weight", &module, &is_a));
}

std::string ErrorOf(const std::vector<ParamSpec>& adapter,
                    const AdapterConfig& config = {}) {
  const ModelSpec base = BaseModel();
  absl::StatusOr<AdapterSharePlan> plan =
      PlanAdapterShares("sql", adapter, base, Layouts(base, 2), config);
  REQUIRE_FALSE(plan.ok());
  CHECK(plan.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(plan.status().message());
}

TEST_CASE("Adapters that do not fit the base model are refused by name") {
  std::vector<ParamSpec> a = Adapter(4, {"self_attn.q_proj"});

  std::vector<ParamSpec> bad = a;
  bad.push_back({"model.layers.0.self_attn.q_proj.bias", DType::kF32, {64}});
  CHECK(ErrorOf(bad) ==
        "adapter sql: tensor model.layers.0.self_attn.q_proj.bias is not a "
        "LoRA tensor (PEFT names end in lora_A.weight or lora_B.weight)");

  bad = a;
  bad[0].name = "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight";
  CHECK(ErrorOf(bad) ==
        "adapter sql: tensor "
        "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight "
        "targets base layer model.layers.9.self_attn.q_proj.weight, which the "
        "base model does not have");

  bad = {a[0]};
  CHECK(ErrorOf(bad) ==
        "adapter sql: module model.layers.0.self_attn.q_proj has "
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight but "
        "no lora_B");

  bad = a;
  bad[0].shape = {4, 32};
  CHECK(ErrorOf(bad) ==
        "adapter sql: tensor "
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has "
        "shape [4, 32]; lora_A of model.layers.0.self_attn.q_proj.weight "
        "[64, 64] must be [r, 64]");

  // v_proj is [16, 64]: a rank of 17 is larger than it.
  CHECK(ErrorOf(Adapter(17, {"self_attn.v_proj"})) ==
        "adapter sql: tensor "
        "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight has "
        "rank 17, which is larger than the smaller dim of "
        "model.layers.0.self_attn.v_proj.weight [16, 64]");

  AdapterConfig config;
  config.rank = 8;
  CHECK(ErrorOf(a, config) ==
        "adapter sql: tensor "
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight has "
        "rank 4 but the config's r is 8");

  config = {};
  config.target_modules = {"v_proj"};
  CHECK(ErrorOf(a, config) ==
        "adapter sql: tensor "
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight "
        "targets module q_proj, which target_modules [v_proj] of its config "
        "does not name");

  config.target_modules = {"q_proj", "v_proj"};
  CHECK(ErrorOf(a, config) ==
        "adapter sql: its config targets module v_proj but no tensor of the "
        "adapter stream does");
}

}  // namespace
}  // namespace ferry
