#include "core/models/trainer_layout.h"

#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "absl/strings/str_cat.h"
#include "core/models/model_schema.h"
#include "tests/models/layout_checks.h"

namespace ferry {
namespace {

// Schemas are loaded once per test binary; the big ones take a moment.
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

std::string Describe(const TrainerParallelism& p) {
  return absl::StrCat("tp ", p.tp, " pp ", p.pp, " dp ", p.dp, " ep ", p.ep,
                      p.fsdp ? " fsdp" : "", p.fused_qkv ? " fused_qkv" : "");
}

TrainerParallelism Mix(int tp, int pp, int dp, int ep = 1) {
  TrainerParallelism p;
  p.tp = tp;
  p.pp = pp;
  p.dp = dp;
  p.ep = ep;
  return p;
}

TrainerParallelism Fsdp(int dp) {
  TrainerParallelism p = Mix(1, 1, dp);
  p.fsdp = true;
  return p;
}

TrainerParallelism Fused(int tp, int pp, int dp) {
  TrainerParallelism p = Mix(tp, pp, dp);
  p.fused_qkv = true;
  return p;
}

std::vector<RankLayout> Build(const ModelSchema& s,
                              const TrainerParallelism& p) {
  auto ranks = BuildTrainerLayout(s.spec, s.config, p);
  INFO(s.name << " " << Describe(p) << ": " << ranks.status().ToString());
  REQUIRE(ranks.ok());
  REQUIRE(ranks->size() == static_cast<size_t>(p.tp * p.pp * p.dp));
  return std::move(*ranks);
}

void CheckTiles(const std::string& model,
                const std::vector<TrainerParallelism>& mixes) {
  const ModelSchema& s = Schema(model);
  for (const TrainerParallelism& p : mixes) {
    const auto ranks = Build(s, p);
    INFO(model << " " << Describe(p));
    CHECK(CheckTiling(s.spec, ranks) == "");
    for (size_t r = 0; r < ranks.size(); ++r) {
      CHECK(ranks[r].rank == static_cast<int32_t>(r));
      CHECK(ranks[r].node == absl::StrCat("train-", r / 8));
      REQUIRE(ranks[r].buffer_bytes.size() == 1);
    }
  }
}

TEST_CASE("Trainer layouts of tiny-llama tile every parameter") {
  CheckTiles("tiny-llama",
             {Mix(1, 1, 1), Mix(2, 1, 1), Mix(4, 1, 1), Mix(8, 1, 1),
              Mix(3, 1, 1), Mix(2, 2, 2), Mix(1, 2, 3), Mix(2, 1, 1, 2),
              Fused(2, 1, 2), Fused(1, 2, 1), Fsdp(1), Fsdp(4), Fsdp(7)});
}

TEST_CASE("Trainer layouts of tiny-moe tile every parameter") {
  CheckTiles("tiny-moe", {Mix(2, 1, 2, 4), Mix(1, 1, 4, 2), Mix(2, 2, 1, 2),
                          Mix(3, 1, 1, 3), Mix(1, 2, 4, 4), Mix(4, 1, 2, 8),
                          Fused(2, 2, 2), Fsdp(5)});
}

TEST_CASE("Trainer layouts of llama-3.1-8b tile every parameter") {
  CheckTiles("llama-3.1-8b", {Mix(8, 1, 1), Mix(4, 4, 2), Mix(2, 3, 1),
                              Fused(8, 2, 1), Mix(16, 1, 1), Fsdp(64)});
}

TEST_CASE("Trainer layouts of DeepSeek-V3 keep FP8 scales with their blocks") {
  const ModelSchema& s = Schema("deepseek-v3");
  const TrainerParallelism p = Mix(8, 4, 1, 8);
  const auto ranks = Build(s, p);
  CHECK(CheckTiling(s.spec, ranks) == "");
  // Each rank's share of an FP8 weight starts and ends on 128-row block
  // boundaries (or the tensor end), and its scale shard is exactly those
  // blocks' scale rows.
  int checked = 0;
  for (const RankLayout& rank : ranks) {
    std::map<int32_t, Box> box_of;
    for (const Piece& piece : rank.pieces) box_of[piece.param] = piece.box;
    for (const auto& [param, box] : box_of) {
      const ParamSpec& weight = s.spec.params[param];
      const int32_t scale = s.spec.Find(weight.name + "_scale_inv");
      if (scale < 0) continue;
      REQUIRE(box_of.count(scale) == 1);
      const Box& sb = box_of[scale];
      for (size_t d = 0; d < 2; ++d) {
        INFO(weight.name << " dim " << d << " on rank " << rank.rank);
        CHECK(box.offset[d] % 128 == 0);
        CHECK(sb.offset[d] == box.offset[d] / 128);
        CHECK(sb.offset[d] + sb.extent[d] ==
              (box.offset[d] + box.extent[d] + 127) / 128);
      }
      ++checked;
    }
  }
  CHECK(checked > 0);
  // FSDP over mixed dtypes (F8_E4M3 weights, F32 scales, BF16 norms).
  CHECK(CheckTiling(s.spec, Build(s, Fsdp(48))) == "");
}

TEST_CASE("Trainer layout splits like Megatron") {
  const ModelSchema& s = Schema("llama-3.1-8b");
  const auto ranks = Build(s, Mix(8, 2, 2));
  auto box_on = [&](int rank, const std::string& name) {
    const int32_t id = s.spec.Find(name);
    for (const Piece& p : ranks[rank].pieces) {
      if (p.param == id) return BoxToString(p.box);
    }
    return std::string("none");
  };
  // Rank 11 = tp 3, dp 1, stage 0 (layers 0-15).
  CHECK(box_on(11, "model.layers.0.self_attn.q_proj.weight") ==
        "[1536:2048, 0:4096]");
  CHECK(box_on(11, "model.layers.0.self_attn.k_proj.weight") ==
        "[384:512, 0:4096]");
  CHECK(box_on(11, "model.layers.0.self_attn.o_proj.weight") ==
        "[0:4096, 1536:2048]");
  CHECK(box_on(11, "model.layers.15.mlp.down_proj.weight") ==
        "[0:4096, 5376:7168]");
  CHECK(box_on(11, "model.layers.16.mlp.down_proj.weight") == "none");
  CHECK(box_on(11, "model.embed_tokens.weight") == "[48384:64512, 0:4096]");
  CHECK(box_on(11, "lm_head.weight") == "none");  // 128256 pads to 129024
  CHECK(box_on(3, "model.layers.0.input_layernorm.weight") == "[0:4096]");
  // Rank 23 = tp 7, last stage: the last vocab shard, padded in memory.
  CHECK(box_on(23, "lm_head.weight") == "[112896:128256, 0:4096]");
  CHECK(box_on(23, "model.norm.weight") == "[0:4096]");
  // DP replicas hold the same boxes at the same offsets.
  for (int r = 0; r < 8; ++r) {
    const RankLayout& a = ranks[r];
    const RankLayout& b = ranks[r + 8];
    REQUIRE(a.pieces.size() == b.pieces.size());
    for (size_t i = 0; i < a.pieces.size(); ++i) {
      CHECK(a.pieces[i].box == b.pieces[i].box);
      CHECK(a.pieces[i].byte_offset == b.pieces[i].byte_offset);
    }
  }
}

TEST_CASE("Fused linear_qkv interleaves q heads, k head, v head per group") {
  const ModelSchema& s = Schema("tiny-llama");  // 4 heads, 2 kv heads, 16
  const auto ranks = Build(s, Fused(1, 1, 1));
  const int32_t q = s.spec.Find("model.layers.0.self_attn.q_proj.weight");
  const int32_t k = s.spec.Find("model.layers.0.self_attn.k_proj.weight");
  const int32_t v = s.spec.Find("model.layers.0.self_attn.v_proj.weight");
  std::vector<std::pair<int32_t, std::string>> order;
  int64_t base = -1;
  for (const Piece& p : ranks[0].pieces) {
    if (p.param != q && p.param != k && p.param != v) continue;
    if (base < 0) base = p.byte_offset;
    // Rows of 64 bf16 columns: 128 bytes per local row.
    order.emplace_back(p.param, absl::StrCat(BoxToString(p.box), "@",
                                             (p.byte_offset - base) / 128));
  }
  const std::vector<std::pair<int32_t, std::string>> want = {
      {q, "[0:32, 0:64]@0"},   {k, "[0:16, 0:64]@32"},
      {v, "[0:16, 0:64]@48"},  {q, "[32:64, 0:64]@64"},
      {k, "[16:32, 0:64]@96"}, {v, "[16:32, 0:64]@112"}};
  CHECK(order == want);
  // Megatron needs a kv group per rank.
  CHECK_FALSE(BuildTrainerLayout(s.spec, s.config, Fused(4, 1, 1)).ok());
}

TEST_CASE("Expert parallelism places each expert whole on one rank per group") {
  const ModelSchema& s = Schema("tiny-moe");  // 4 experts
  const auto ranks = Build(s, Mix(2, 1, 2, 2));
  const int32_t e3 = s.spec.Find("model.layers.1.mlp.experts.3.up_proj.weight");
  int holders = 0;
  for (const RankLayout& r : ranks) {
    for (const Piece& p : r.pieces) {
      if (p.param == e3) {
        ++holders;
        CHECK(p.box == FullBox(s.spec.params[e3].shape));
        CHECK(r.rank % 2 == 1);  // ep rank 1 holds experts 2 and 3
      }
    }
  }
  CHECK(holders == 2);  // two EP groups of two ranks
  CHECK_FALSE(BuildTrainerLayout(s.spec, s.config, Mix(2, 1, 1, 4)).ok());
}

TEST_CASE("FSDP ranks hold equal contiguous slices of the flat parameters") {
  const ModelSchema& s = Schema("tiny-llama");
  const auto ranks = Build(s, Fsdp(4));
  for (const RankLayout& r : ranks) {
    int64_t next = 0;
    for (const Piece& p : r.pieces) {
      CHECK(p.byte_offset == next);
      next += Volume(p.box) * 2;
    }
    CHECK(next == TotalBytes(s.spec) / 4);  // 213632 / 4, no padding here
  }
}

TEST_CASE("Tied embeddings keep a copy on the last stage") {
  ModelSchema s = Schema("tiny-llama");
  s.spec.params.pop_back();  // lm_head.weight
  s.spec.BuildIndex();
  s.config.tie_word_embeddings = true;
  const auto ranks = Build(s, Mix(2, 2, 1));
  CHECK(CheckTiling(s.spec, ranks) == "");
  for (const RankLayout& r : ranks) {
    CHECK(std::any_of(r.pieces.begin(), r.pieces.end(),
                      [](const Piece& p) { return p.param == 0; }));
  }
}

TEST_CASE("Block-quantized weights split on whole blocks") {
  // A GGUF Q4_K row-parallel weight: 1024 columns are 4 blocks of 256, so
  // tp 3 splits them 2, 1, 1 blocks, never inside one.
  ModelSpec spec;
  spec.params = {
      {"model.layers.0.mlp.down_proj.weight", DType::kQ4_K, {64, 1024}},
      {"model.layers.0.mlp.up_proj.weight", DType::kQ4_K, {96, 256}}};
  spec.BuildIndex();
  ModelConfig config;
  config.num_layers = 1;
  auto ranks = BuildTrainerLayout(spec, config, Mix(3, 1, 1));
  REQUIRE(ranks.ok());
  CHECK(CheckTiling(spec, *ranks) == "");
  CHECK(BoxToString((*ranks)[0].pieces[0].box) == "[0:64, 0:512]");
  CHECK(BoxToString((*ranks)[2].pieces[0].box) == "[0:64, 768:1024]");
  CHECK(BoxToString((*ranks)[1].pieces[1].box) == "[32:64, 0:256]");
  // 64 x 2 blocks of 144 bytes.
  CHECK((*ranks)[0].pieces[1].byte_offset == 18432);
}

TEST_CASE("Bad trainer parallelism is an error") {
  const ModelSchema& s = Schema("tiny-llama");
  CHECK(BuildTrainerLayout(s.spec, s.config, Mix(0, 1, 1)).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(BuildTrainerLayout(s.spec, s.config, Mix(2, 1, 1, 3)).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry
