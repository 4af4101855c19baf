#include "core/models/config_model.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

class SpecWriter {
 public:
  SpecWriter(DType dtype, int64_t fp8_block)
      : dtype_(dtype), fp8_block_(fp8_block) {}

  // A tensor in the model's dtype (norms, embeddings, routers).
  void Plain(const std::string& name, Dims shape) {
    spec_.params.push_back(ParamSpec{name, dtype_, std::move(shape)});
  }
  void F32(const std::string& name, Dims shape) {
    spec_.params.push_back(ParamSpec{name, DType::kF32, std::move(shape)});
  }
  // A linear weight: FP8 with its block scales right after it when the
  // checkpoint is block-quantized, else the model's dtype.
  void Linear(const std::string& name, int64_t rows, int64_t cols) {
    if (fp8_block_ == 0) {
      Plain(name + ".weight", {rows, cols});
      return;
    }
    spec_.params.push_back(ParamSpec{name + ".weight", DType::kF8E4M3, {rows, cols}});
    F32(name + ".weight_scale_inv",
        {CeilDiv(rows, fp8_block_), CeilDiv(cols, fp8_block_)});
  }
  ModelSpec Take() {
    spec_.BuildIndex();
    return std::move(spec_);
  }

 private:
  const DType dtype_;
  const int64_t fp8_block_;
  ModelSpec spec_;
};

absl::Status Need(const ModelConfig& c, int64_t value, const char* field) {
  if (value > 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      c.architecture, " config: ", field, " must be set and positive"));
}

absl::StatusOr<DType> ModelDType(const ModelConfig& c) {
  if (c.torch_dtype.empty() || c.torch_dtype == "bfloat16") return DType::kBF16;
  if (c.torch_dtype == "float16") return DType::kF16;
  if (c.torch_dtype == "float32") return DType::kF32;
  return absl::InvalidArgumentError(absl::StrCat(
      "config torch_dtype '", c.torch_dtype,
      "' is not bfloat16, float16 or float32"));
}

void Mlp(SpecWriter& w, const std::string& prefix, int64_t hidden,
         int64_t inter) {
  w.Linear(prefix + "gate_proj", inter, hidden);
  w.Linear(prefix + "up_proj", inter, hidden);
  w.Linear(prefix + "down_proj", hidden, inter);
}

bool QwenMoeLayer(const ModelConfig& c, int64_t layer) {
  if (c.num_experts == 0) return false;
  if (std::find(c.mlp_only_layers.begin(), c.mlp_only_layers.end(), layer) !=
      c.mlp_only_layers.end()) {
    return false;
  }
  return (layer + 1) % c.decoder_sparse_step == 0;
}

}  // namespace

absl::StatusOr<ModelSpec> ModelSpecFromConfig(const ModelConfig& c) {
  absl::StatusOr<DType> dtype = ModelDType(c);
  if (!dtype.ok()) return dtype.status();
  const std::string& arch = c.architecture;
  const bool llama = arch == "LlamaForCausalLM" || arch == "MistralForCausalLM";
  const bool qwen3 = arch == "Qwen3ForCausalLM";
  const bool qwen3_moe = arch == "Qwen3MoeForCausalLM";
  const bool deepseek = arch == "DeepseekV3ForCausalLM";
  if (!llama && !qwen3 && !qwen3_moe && !deepseek) {
    return absl::InvalidArgumentError(absl::StrCat(
        "architecture '", arch, "' is not one ferry builds tables for "
        "(LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM, "
        "Qwen3MoeForCausalLM, DeepseekV3ForCausalLM): declare its engine "
        "table by hand (docs/python.md)"));
  }
  for (auto [v, f] : {std::pair<int64_t, const char*>{c.hidden_size, "hidden_size"},
                      {c.num_layers, "num_hidden_layers"},
                      {c.num_attention_heads, "num_attention_heads"},
                      {c.vocab_size, "vocab_size"}}) {
    if (absl::Status s = Need(c, v, f); !s.ok()) return s;
  }
  const int64_t H = c.hidden_size;
  SpecWriter w(*dtype, deepseek ? c.fp8_block : 0);
  w.Plain("model.embed_tokens.weight", {c.vocab_size, H});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    w.Plain(p + "input_layernorm.weight", {H});
    if (deepseek) {
      // MLA: q through a low-rank pair (or one q_proj without
      // q_lora_rank), k/v through kv_a (latent + rope) and kv_b.
      const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
      if (c.q_lora_rank > 0) {
        w.Linear(p + "self_attn.q_a_proj", c.q_lora_rank, H);
        w.Plain(p + "self_attn.q_a_layernorm.weight", {c.q_lora_rank});
        w.Linear(p + "self_attn.q_b_proj", c.num_attention_heads * qk,
                 c.q_lora_rank);
      } else {
        w.Linear(p + "self_attn.q_proj", c.num_attention_heads * qk, H);
      }
      w.Linear(p + "self_attn.kv_a_proj_with_mqa",
               c.kv_lora_rank + c.qk_rope_head_dim, H);
      w.Plain(p + "self_attn.kv_a_layernorm.weight", {c.kv_lora_rank});
      w.Linear(p + "self_attn.kv_b_proj",
               c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim),
               c.kv_lora_rank);
      w.Linear(p + "self_attn.o_proj", H, c.num_attention_heads * c.v_head_dim);
    } else {
      const int64_t kv = c.num_kv_heads > 0 ? c.num_kv_heads : c.num_attention_heads;
      w.Linear(p + "self_attn.q_proj", c.num_attention_heads * c.head_dim, H);
      w.Linear(p + "self_attn.k_proj", kv * c.head_dim, H);
      w.Linear(p + "self_attn.v_proj", kv * c.head_dim, H);
      w.Linear(p + "self_attn.o_proj", H, c.num_attention_heads * c.head_dim);
      if (qwen3 || qwen3_moe) {
        w.Plain(p + "self_attn.q_norm.weight", {c.head_dim});
        w.Plain(p + "self_attn.k_norm.weight", {c.head_dim});
      }
    }
    w.Plain(p + "post_attention_layernorm.weight", {H});
    const bool moe = deepseek ? c.num_experts > 0 && l >= c.first_k_dense_replace
                              : qwen3_moe && QwenMoeLayer(c, l);
    if (!moe) {
      Mlp(w, p + "mlp.", H, c.intermediate_size);
      continue;
    }
    w.Plain(p + "mlp.gate.weight", {c.num_experts, H});
    if (deepseek) w.F32(p + "mlp.gate.e_score_correction_bias", {c.num_experts});
    for (int64_t e = 0; e < c.num_experts; ++e) {
      Mlp(w, absl::StrCat(p, "mlp.experts.", e, "."), H, c.moe_intermediate_size);
    }
    if (deepseek && c.num_shared_experts > 0) {
      Mlp(w, p + "mlp.shared_experts.", H,
          c.moe_intermediate_size * c.num_shared_experts);
    }
  }
  w.Plain("model.norm.weight", {H});
  if (!c.tie_word_embeddings) w.Plain("lm_head.weight", {c.vocab_size, H});
  return w.Take();
}

absl::StatusOr<std::vector<EngineTable>> VllmTablesFromConfig(
    absl::string_view config_json, const EngineParallelism& parallelism,
    ModelSpec* spec) {
  absl::StatusOr<ModelConfig> config = ParseHfConfig(config_json, "config.json");
  if (!config.ok()) return config.status();
  absl::StatusOr<ModelSpec> model = ModelSpecFromConfig(*config);
  if (!model.ok()) return model.status();
  absl::StatusOr<std::vector<EngineTable>> tables =
      BuildEngineTables(*model, *config, parallelism);
  if (tables.ok() && spec != nullptr) *spec = *std::move(model);
  return tables;
}

}  // namespace ferry
