#include "core/models/model_schema.h"

#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <string>

#include "core/models/models_dir.h"
#include "core/models/scaled_model.h"

namespace ferry {
namespace {

ModelSchema Load(const std::string& name, const SchemaOptions& options = {}) {
  auto schema = LoadNamedModelSchema(name, options);
  INFO(name << ": " << schema.status().ToString());
  REQUIRE(schema.ok());
  return std::move(*schema);
}

// A scratch file under Bazel's per-test temp dir.
std::string WriteTemp(const std::string& name, const std::string& text) {
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST_CASE("Every schema expands to the totals its file declares") {
  for (const char* name : {"tiny-llama", "tiny-moe", "llama-3.1-8b",
                           "llama-3.1-70b", "qwen3-30b-a3b", "qwen3-235b-a22b",
                           "deepseek-v3", "kimi-k2-instruct"}) {
    const ModelSchema s = Load(name);
    INFO(name);
    CHECK_FALSE(s.name.empty());
    CHECK(static_cast<int64_t>(s.spec.params.size()) == s.declared_num_tensors);
    CHECK(TotalBytes(s.spec) == s.declared_total_bytes);
    for (size_t i = 0; i < s.spec.params.size(); ++i) {
      CHECK(s.spec.Find(s.spec.params[i].name) == static_cast<int32_t>(i));
    }
  }
}

TEST_CASE("Published sizes of the reference models") {
  const ModelSchema llama = Load("llama-3.1-8b");
  CHECK(llama.spec.params.size() == 291);
  CHECK(TotalBytes(llama.spec) == 16060522496);
  CHECK(Load("kimi-k2-instruct").spec.params.size() == 139583);
  CHECK(Load("deepseek-v3").spec.params.size() == 90427);
}

TEST_CASE("Parameters come in checkpoint (module) order") {
  const ModelSchema llama = Load("llama-3.1-8b");
  const auto& p = llama.spec.params;
  CHECK(p[0].name == "model.embed_tokens.weight");
  CHECK(p[1].name == "model.layers.0.input_layernorm.weight");
  CHECK(p[2].name == "model.layers.0.self_attn.q_proj.weight");
  CHECK(p[10].name == "model.layers.1.input_layernorm.weight");
  CHECK(p[289].name == "model.norm.weight");
  CHECK(p[290].name == "lm_head.weight");
  CHECK(p[2].dtype == DType::kBF16);
  CHECK(p[2].shape == Dims{4096, 4096});

  // DeepSeek-V3: experts one after another, each weight followed by its
  // FP8 scale; dense layers before the MoE ones.
  const ModelSchema ds = Load("deepseek-v3");
  const int32_t e0 =
      ds.spec.Find("model.layers.3.mlp.experts.0.gate_proj.weight");
  REQUIRE(e0 > 0);
  const auto& d = ds.spec.params;
  CHECK(d[e0 - 1].name == "model.layers.3.mlp.gate.e_score_correction_bias");
  CHECK(d[e0].dtype == DType::kF8E4M3);
  CHECK(d[e0 + 1].name ==
        "model.layers.3.mlp.experts.0.gate_proj.weight_scale_inv");
  CHECK(d[e0 + 1].dtype == DType::kF32);
  CHECK(d[e0 + 1].shape == Dims{16, 56});
  CHECK(d[e0 + 2].name == "model.layers.3.mlp.experts.0.up_proj.weight");
  CHECK(d[e0 + 6].name == "model.layers.3.mlp.experts.1.gate_proj.weight");
  CHECK(ds.spec.Find("model.layers.2.mlp.gate_proj.weight") < e0);
  CHECK(ds.spec.Find("model.layers.3.mlp.gate_proj.weight") == -1);
}

TEST_CASE("Model configs carry the sharding-relevant fields") {
  const ModelConfig llama = Load("llama-3.1-8b").config;
  CHECK(llama.architecture == "LlamaForCausalLM");
  CHECK(llama.hidden_size == 4096);
  CHECK(llama.intermediate_size == 14336);
  CHECK(llama.num_layers == 32);
  CHECK(llama.num_attention_heads == 32);
  CHECK(llama.num_kv_heads == 8);
  CHECK(llama.head_dim == 128);
  CHECK(llama.vocab_size == 128256);
  CHECK_FALSE(llama.is_moe());
  CHECK(llama.fp8_block == 0);

  const ModelConfig qwen = Load("qwen3-30b-a3b").config;
  CHECK(qwen.num_experts == 128);
  CHECK(qwen.moe_intermediate_size == 768);

  const ModelConfig ds = Load("deepseek-v3").config;
  CHECK(ds.num_experts == 256);  // n_routed_experts
  CHECK(ds.num_shared_experts == 1);
  CHECK(ds.first_k_dense_replace == 3);
  CHECK(ds.is_mla());
  CHECK(ds.head_dim == 0);
  CHECK(ds.kv_lora_rank == 512);
  CHECK(ds.qk_rope_head_dim == 64);
  CHECK(ds.fp8_block == 128);
}

TEST_CASE("DeepSeek-V3's MTP layer is opt-in") {
  SchemaOptions with_mtp;
  with_mtp.include_mtp = true;
  const ModelSchema ds = Load("deepseek-v3", with_mtp);
  CHECK(ds.spec.params.size() == 90427 + 1564);
  CHECK(TotalBytes(ds.spec) == int64_t{673150611808} + 15424227552);
  CHECK(ds.spec.Find("model.layers.61.eh_proj.weight") >= 0);
}

TEST_CASE("Schema errors name the file and the field") {
  auto missing = LoadModelSchema("/nonexistent/ferry/model.json");
  CHECK(missing.status().code() == absl::StatusCode::kNotFound);
  CHECK(std::string(missing.status().message()).find("/nonexistent") !=
        std::string::npos);

  const std::string garbage = WriteTemp("garbage.json", "{\"config\": [");
  auto bad_json = LoadModelSchema(garbage);
  CHECK(bad_json.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(bad_json.status().message()).find(garbage) !=
        std::string::npos);

  const std::string bad_shape =
      WriteTemp("bad_shape.json",
                R"({"config": {"hidden_size": 4}, "tensors": [
          {"name": "w", "shape": [4, "x"], "dtype": "BF16"}]})");
  auto shape = LoadModelSchema(bad_shape);
  CHECK(shape.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(shape.status().message()).find("tensors[0] (w).shape") !=
        std::string::npos);

  const std::string bad_dtype = WriteTemp(
      "bad_dtype.json",
      R"({"config": {}, "tensors": [{"name": "w", "shape": [4], "dtype": "Q9"}]})");
  auto dtype = LoadModelSchema(bad_dtype);
  CHECK(std::string(dtype.status().message()).find("(w).dtype") !=
        std::string::npos);

  const std::string bad_config =
      WriteTemp("bad_config.json",
                R"({"config": {"hidden_size": "big"}, "tensors": []})");
  auto config = LoadModelSchema(bad_config);
  CHECK(std::string(config.status().message()).find("config.hidden_size") !=
        std::string::npos);

  const std::string bad_group =
      WriteTemp("bad_group.json",
                R"({"config": {}, "tensors": [{"name": "l.{L}.w", "shape": [4],
          "dtype": "BF16", "layers": "all"}]})");
  auto group = LoadModelSchema(bad_group);
  CHECK(std::string(group.status().message()).find("(l.{L}.w).layers") !=
        std::string::npos);
}

TEST_CASE("FindModelsDir honours FERRY_MODELS_DIR and otherwise searches") {
  auto found = FindModelsDir();
  INFO(found.status().ToString());
  REQUIRE(found.ok());
  CHECK(std::ifstream(*found + "/llama-3.1-8b.json").good());

  ::setenv("FERRY_MODELS_DIR", "/nonexistent/ferry/models", 1);
  CHECK(FindModelsDir().status().code() == absl::StatusCode::kNotFound);
  ::setenv("FERRY_MODELS_DIR", found->c_str(), 1);
  CHECK(*FindModelsDir() == *found);
  ::unsetenv("FERRY_MODELS_DIR");
}

TEST_CASE("ScaleModel shrinks Llama-3.1-8B to a 1-2 GB demo model") {
  const ModelSchema llama = Load("llama-3.1-8b");
  auto demo = ScaleModel(llama, DemoScale());
  INFO(demo.status().ToString());
  REQUIRE(demo.ok());
  CHECK(demo->spec.params.size() == 3 + 6 * 9);
  CHECK(TotalBytes(demo->spec) > int64_t{1} << 30);
  CHECK(TotalBytes(demo->spec) < int64_t{2} << 30);
  CHECK(demo->config.num_layers == 6);
  CHECK(demo->spec.Find("model.layers.5.self_attn.k_proj.weight") >= 0);
  CHECK(demo->spec.Find("model.layers.6.self_attn.k_proj.weight") == -1);
  const auto& k =
      demo->spec
          .params[demo->spec.Find("model.layers.0.self_attn.k_proj.weight")];
  CHECK(k.shape == Dims{1024, 2048});
  CHECK(k.dtype == DType::kBF16);

  ModelScale too_many;
  too_many.num_layers = 64;
  CHECK_FALSE(ScaleModel(llama, too_many).ok());
  CHECK_FALSE(ScaleModel(Load("deepseek-v3"), DemoScale()).ok());
  CHECK_FALSE(ScaleModel(Load("tiny-moe"), DemoScale()).ok());
}

}  // namespace
}  // namespace ferry
