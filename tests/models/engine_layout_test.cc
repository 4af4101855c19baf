#include "core/models/engine_layout.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/models/model_schema.h"
#include "tests/models/layout_checks.h"

namespace ferry {
namespace {

const ModelSchema& Schema(const std::string& name) {
  static auto* cache = new std::map<std::string, ModelSchema>();
  auto it = cache->find(name);
  if (it == cache->end()) {
    auto loaded = LoadNamedModelSchema(name);
    INFO(loaded.status().ToString());
    REQUIRE(loaded.ok());
    it = cache->emplace(name, std::move(*loaded)).first;
  }
  return it->second;
}

std::vector<EngineTable> Tables(const std::string& model, int tp,
                                bool expert_parallel = false) {
  const ModelSchema& s = Schema(model);
  EngineParallelism p;
  p.tp = tp;
  p.expert_parallel = expert_parallel;
  auto tables = BuildEngineTables(s.spec, s.config, p);
  INFO(model << " tp " << tp << ": " << tables.status().ToString());
  REQUIRE(tables.ok());
  REQUIRE(tables->size() == static_cast<size_t>(tp));
  return std::move(*tables);
}

const EngineParam& Param(const EngineTable& t, const std::string& name) {
  auto it = std::find_if(t.params.begin(), t.params.end(),
                         [&](const EngineParam& p) { return p.name == name; });
  INFO(name);
  REQUIRE(it != t.params.end());
  return *it;
}

TEST_CASE("llama-3.1-8b engine shapes are vLLM's for tp 1, 2, 4, 8") {
  for (int tp : {1, 2, 4, 8}) {
    INFO("tp " << tp);
    const auto tables = Tables("llama-3.1-8b", tp);
    for (const EngineTable& t : tables) {
      CHECK(t.tp_size == tp);
      const EngineParam& qkv =
          Param(t, "model.layers.0.self_attn.qkv_proj.weight");
      // 32 q heads and 8 kv heads of 128, split by tp.
      CHECK(qkv.local_shape == Dims{(32 + 2 * 8) * 128 / tp, 4096});
      CHECK(qkv.loader == LoaderKind::kFused);
      REQUIRE(qkv.parts.size() == 3);
      CHECK(qkv.parts[1].checkpoint_name ==
            "model.layers.0.self_attn.k_proj.weight");
      const EngineParam& gate_up =
          Param(t, "model.layers.31.mlp.gate_up_proj.weight");
      CHECK(gate_up.local_shape == Dims{2 * 14336 / tp, 4096});
      CHECK(gate_up.parts.size() == 2);
      const EngineParam& o = Param(t, "model.layers.0.self_attn.o_proj.weight");
      CHECK(o.local_shape == Dims{4096, 4096 / tp});
      CHECK(o.loader == LoaderKind::kRow);
      CHECK(o.shard_dim == 1);
      CHECK(Param(t, "model.layers.0.mlp.down_proj.weight").local_shape ==
            Dims{4096, 14336 / tp});
      // 128256 is already a multiple of 64 and of 64 * 8 / 8.
      CHECK(Param(t, "model.embed_tokens.weight").local_shape ==
            Dims{128256 / tp, 4096});
      CHECK(Param(t, "lm_head.weight").loader == LoaderKind::kVocabParallel);
      CHECK(Param(t, "model.norm.weight").loader == LoaderKind::kReplicated);
      CHECK(t.params.size() == 3 + 32 * 6);
    }
  }
}

TEST_CASE("qwen3-30b-a3b engine shapes are vLLM's for tp 1, 2, 4, 8") {
  for (int tp : {1, 2, 4, 8}) {
    INFO("tp " << tp);
    const auto tables = Tables("qwen3-30b-a3b", tp);
    const EngineTable& t = tables.back();
    // 32 q heads, 4 kv heads: at tp 8 each rank holds one kv head.
    const int64_t kv_heads = std::max(1, 4 / tp);
    CHECK(Param(t, "model.layers.0.self_attn.qkv_proj.weight").local_shape ==
          Dims{(32 / tp + 2 * kv_heads) * 128, 2048});
    const EngineParam& w13 = Param(t, "model.layers.0.mlp.experts.w13_weight");
    CHECK(w13.local_shape == Dims{128, 2 * 768 / tp, 2048});
    REQUIRE(w13.parts.size() == 256);
    CHECK(w13.parts[2].checkpoint_name ==
          "model.layers.0.mlp.experts.1.gate_proj.weight");
    CHECK(w13.parts[3].checkpoint_name ==
          "model.layers.0.mlp.experts.1.up_proj.weight");
    CHECK(w13.parts[3].lead_index == Dims{1});
    const EngineParam& w2 = Param(t, "model.layers.47.mlp.experts.w2_weight");
    CHECK(w2.local_shape == Dims{128, 2048, 768 / tp});
    CHECK(w2.shard_dim == 1);
    CHECK(w2.parts.size() == 128);
    // Every rank declares every expert's parts: one list for all ranks.
    CHECK(w13.parts.SharesWith(
        Param(tables.front(), "model.layers.0.mlp.experts.w13_weight").parts));
    CHECK(Param(t, "model.layers.0.mlp.gate.weight").loader ==
          LoaderKind::kReplicated);
    CHECK(Param(t, "model.layers.0.self_attn.q_norm.weight").local_shape ==
          Dims{128});
    CHECK(Param(t, "lm_head.weight").local_shape == Dims{151936 / tp, 2048});
  }
}

TEST_CASE("Expert parallelism gives each rank E/tp whole experts") {
  const auto tables = Tables("qwen3-30b-a3b", 8, /*expert_parallel=*/true);
  const EngineParam& w13 =
      Param(tables[1], "model.layers.0.mlp.experts.w13_weight");
  CHECK(w13.local_shape == Dims{16, 2 * 768, 2048});
  REQUIRE(w13.parts.size() == 32);
  CHECK(w13.parts[0].checkpoint_name ==
        "model.layers.0.mlp.experts.16.gate_proj.weight");
  CHECK(w13.parts[0].lead_index == Dims{0});
  // Ranks hold other experts here: lists of their own.
  CHECK(!w13.parts.SharesWith(
      Param(tables[0], "model.layers.0.mlp.experts.w13_weight").parts));
  CHECK(Param(tables[1], "model.layers.0.mlp.experts.w2_weight").local_shape ==
        Dims{16, 2048, 768});
}

TEST_CASE("DeepSeek-V3 engine tables carry FP8 scales and flag kv_b_proj") {
  const auto tables = Tables("deepseek-v3", 8);
  const EngineTable& t = tables[0];
  CHECK(Param(t, "model.layers.0.self_attn.q_b_proj.weight").local_shape ==
        Dims{3072, 1536});
  CHECK(Param(t, "model.layers.0.self_attn.q_b_proj.weight_scale_inv")
            .local_shape == Dims{24, 12});
  CHECK(Param(t, "model.layers.0.self_attn.q_a_proj.weight").loader ==
        LoaderKind::kReplicated);
  const EngineParam& kv_b =
      Param(t, "model.layers.0.self_attn.kv_b_proj.weight");
  CHECK((kv_b.flags & kFlagTransformed) != 0);
  CHECK(Param(t, "model.layers.0.mlp.gate_up_proj.weight_scale_inv")
            .local_shape == Dims{2 * 144 / 8, 56});
  CHECK(Param(t, "model.layers.3.mlp.experts.w13_weight").local_shape ==
        Dims{256, 512, 7168});
  CHECK(Param(t, "model.layers.3.mlp.experts.w13_weight").dtype ==
        DType::kF8E4M3);
  const EngineParam& s13 =
      Param(t, "model.layers.3.mlp.experts.w13_weight_scale_inv");
  CHECK(s13.local_shape == Dims{256, 4, 56});
  CHECK(s13.dtype == DType::kF32);
  CHECK(s13.parts[1].checkpoint_name ==
        "model.layers.3.mlp.experts.0.up_proj.weight_scale_inv");
  CHECK(
      Param(t, "model.layers.3.mlp.experts.w2_weight_scale_inv").local_shape ==
      Dims{256, 56, 2});
  CHECK(Param(t, "model.layers.3.mlp.shared_experts.gate_up_proj.weight")
            .local_shape == Dims{512, 7168});
}

// Every checkpoint tensor is named by exactly one live parameter of each
// rank (as itself, as a fused part, or as something a custom loader
// consumes), and the live parameters sit in buffer 0 without overlapping.
void CheckTables(const std::string& model, int tp, bool ep = false) {
  const ModelSchema& s = Schema(model);
  INFO(model << " tp " << tp << (ep ? " ep" : ""));
  const auto tables = Tables(model, tp, ep);
  std::map<std::string, int> named;
  for (const EngineTable& t : tables) {
    REQUIRE(t.buffer_bytes.size() == 1);
    CHECK(t.node == absl::StrCat("infer-", t.tp_rank / 8));
    int64_t end = 0;
    for (const EngineParam& p : t.params) {
      CHECK(p.buffer == 0);
      CHECK(p.byte_offset % 256 == 0);
      CHECK(p.byte_offset >= end);
      end = p.byte_offset +
            Volume(StorageShape(p.local_shape, p.dtype)) * UnitBytes(p.dtype);
      if (!p.parts.empty()) {
        for (const FusedPart& part : p.parts) named[part.checkpoint_name]++;
      } else if (!p.consumes.empty()) {
        for (const std::string& c : p.consumes) named[c]++;
      } else {
        named[p.name]++;
      }
    }
    CHECK(end <= t.buffer_bytes[0]);
  }
  CHECK(named.size() == s.spec.params.size());
  for (const auto& [name, count] : named) {
    INFO(name);
    CHECK(s.spec.Find(name) >= 0);
    CHECK(count ==
          (ep && name.find(".experts.") != std::string::npos ? 1 : tp));
  }
}

TEST_CASE("Engine tables name every checkpoint tensor once per rank") {
  CheckTables("tiny-llama", 2);
  CheckTables("tiny-moe", 2);
  CheckTables("tiny-moe", 4, true);
  CheckTables("llama-3.1-8b", 8);
  CheckTables("qwen3-30b-a3b", 4);
  CheckTables("qwen3-30b-a3b", 8, true);
  CheckTables("deepseek-v3", 8);
  CheckTables("kimi-k2-instruct", 16, true);
}

// The tables resolve (core/layout_resolution.h) to direct or fused pieces,
// except what they flag for the engine's loader, and the direct pieces of
// all ranks tile every parameter: the tables say what vLLM allocates.
void CheckResolves(const std::string& model, int tp, bool ep = false) {
  const ModelSchema& s = Schema(model);
  INFO(model << " tp " << tp << (ep ? " ep" : ""));
  auto resolved = ResolveDestinationLayout(s.spec, Tables(model, tp, ep));
  INFO(resolved.status().ToString());
  REQUIRE(resolved.ok());
  std::vector<RankLayout> layouts;
  for (const ResolvedRank& rank : resolved->ranks) {
    for (const ParamDecision& d : rank.decisions) {
      INFO(d.engine_name << ": " << d.reason);
      const bool loader_only =
          d.engine_name.find("kv_b_proj") != std::string::npos;
      CHECK((d.resolution == Resolution::kFallback) == loader_only);
    }
    CHECK(rank.fallback.empty() ==
          (model.find("deepseek") == std::string::npos));
    layouts.push_back(rank.layout);
  }
  if (model.find("deepseek") == std::string::npos) {
    CHECK(CheckTiling(s.spec, layouts) == "");
  }
}

TEST_CASE("Engine tables resolve to pieces that tile the model") {
  for (int tp : {1, 2, 4, 8}) {
    CheckResolves("tiny-moe", std::min(tp, 2));
    CheckResolves("llama-3.1-8b", tp);
    CheckResolves("qwen3-30b-a3b", tp);
    CheckResolves("qwen3-30b-a3b", tp, /*ep=*/true);
  }
  CheckResolves("deepseek-v3", 8);
  CheckResolves("deepseek-v3", 8, /*ep=*/true);
}

TEST_CASE("Engine tables refuse what vLLM refuses") {
  const ModelSchema& s = Schema("tiny-llama");  // 4 heads, 2 kv heads
  EngineParallelism p;
  p.tp = 8;
  auto tables = BuildEngineTables(s.spec, s.config, p);
  CHECK(tables.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(tables.status().message()).find("qkv_proj") !=
        std::string::npos);
  p.tp = 3;
  CHECK_FALSE(BuildEngineTables(s.spec, s.config, p).ok());
  CHECK(EnginePaddedVocab(128256, 8) == 128256);
  CHECK(EnginePaddedVocab(100, 1) == 128);
  CHECK(EnginePaddedVocab(130, 3) == 192);  // 192 = 64 * 3
}

}  // namespace
}  // namespace ferry
