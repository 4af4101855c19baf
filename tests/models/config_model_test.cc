// core/models/config_model.h: a checkpoint's tensor list derived from its
// config alone must equal, tensor for tensor (name, dtype, shape, order),
// the list in the shared/models schema file, which was checked against the
// real checkpoints; and vLLM's tables follow from a config.json's text in
// one call.
#include "core/models/config_model.h"

#include <string>

#include "catch2/catch.hpp"
#include "core/models/model_schema.h"

namespace ferry {
namespace {

TEST_CASE("every schema's tensors follow from its config alone") {
  for (const char* name :
       {"llama-3.1-8b", "llama-3.1-70b", "qwen3-30b-a3b", "qwen3-235b-a22b",
        "deepseek-v3", "kimi-k2-instruct", "tiny-llama", "tiny-moe"}) {
    INFO(name);
    absl::StatusOr<ModelSchema> schema = LoadNamedModelSchema(name);
    REQUIRE(schema.ok());
    absl::StatusOr<ModelSpec> spec = ModelSpecFromConfig(schema->config);
    INFO(spec.status().ToString());
    REQUIRE(spec.ok());
    const ModelSpec& want = schema->spec;
    REQUIRE(spec->params.size() == want.params.size());
    for (size_t i = 0; i < want.params.size(); ++i) {
      INFO("tensor " << i << ": " << want.params[i].name);
      REQUIRE(spec->params[i].name == want.params[i].name);
      CHECK(spec->params[i].dtype == want.params[i].dtype);
      CHECK(spec->params[i].shape == want.params[i].shape);
    }
  }
}

TEST_CASE("vLLM's tables from a config.json's text in one call") {
  const std::string config = R"({
    "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "num_experts": 4, "decoder_sparse_step": 1, "mlp_only_layers": [1],
    "tie_word_embeddings": false, "torch_dtype": "bfloat16"})";
  EngineParallelism p;
  p.tp = 2;
  p.expert_parallel = true;
  ModelSpec spec;
  absl::StatusOr<std::vector<EngineTable>> tables =
      VllmTablesFromConfig(config, p, &spec);
  INFO(tables.status().ToString());
  REQUIRE(tables.ok());
  REQUIRE(tables->size() == 2);
  // Layer 1 is dense (mlp_only_layers): a gate_up_proj, no experts.
  CHECK(spec.Find("model.layers.1.mlp.gate_proj.weight") >= 0);
  CHECK(spec.Find("model.layers.1.mlp.experts.0.up_proj.weight") < 0);
  CHECK(spec.Find("model.layers.0.mlp.experts.3.down_proj.weight") >= 0);
  bool w13 = false;
  for (const EngineParam& e : (*tables)[1].params) {
    if (e.name != "model.layers.0.mlp.experts.w13_weight") continue;
    w13 = true;
    // Expert parallel: rank 1 holds experts 2 and 3 whole.
    CHECK(e.local_shape == Dims{2, 64, 64});
    REQUIRE(e.parts.size() == 4);
    CHECK(e.parts[0].checkpoint_name == "model.layers.0.mlp.experts.2.gate_proj.weight");
    CHECK(e.parts[0].local_extent == 32);
  }
  CHECK(w13);

  CHECK_FALSE(VllmTablesFromConfig("{", p).ok());
  absl::StatusOr<std::vector<EngineTable>> gpt = VllmTablesFromConfig(
      R"({"architectures": ["GPT2LMHeadModel"], "hidden_size": 8,
          "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 8})",
      p);
  REQUIRE_FALSE(gpt.ok());
  CHECK(gpt.status().message().find("GPT2LMHeadModel") != std::string::npos);
}

}  // namespace
}  // namespace ferry
