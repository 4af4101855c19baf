// Model schemas: the checkpoint parameters of a real (or synthetic) LLM.
//
// The files in shared/models/*.json describe a checkpoint as templates
// ("model.layers.{L}.mlp.experts.{E}.up_proj.weight" with a layer group and
// an expert count). LoadModelSchema expands them into a ModelSpec, one
// ParamSpec per checkpoint tensor, in checkpoint (module) order: the tensors
// before the layers, then layer by layer (within a layer, expert by expert
// for the expert tensors), then the tensors after the layers. FP8 weights
// keep their `weight_scale_inv` tensor right after them, as separate F32
// parameters. Tests, the demo and the benchmarks build their layouts from
// these specs, so the specs carry no memory, only names, dtypes and shapes.
#ifndef FERRY_CORE_MODELS_MODEL_SCHEMA_H_
#define FERRY_CORE_MODELS_MODEL_SCHEMA_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/piece.h"

namespace ferry {

// The config.json fields that decide tensor shapes and sharding. A field the
// file does not have (or has as null) is 0 / false.
struct ModelConfig {
  std::string architecture;  // "LlamaForCausalLM", "DeepseekV3ForCausalLM"
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;      // dense MLP
  int64_t moe_intermediate_size = 0;  // one routed expert
  int64_t num_layers = 0;             // num_hidden_layers
  int64_t num_attention_heads = 0;
  int64_t num_kv_heads = 0;  // num_key_value_heads
  // Per-head dim of q/k/v; hidden_size / heads when the config omits it.
  // 0 for MLA models, whose heads use the qk_* and v_head_dim fields.
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
  int64_t num_experts = 0;  // num_experts (Qwen) or n_routed_experts (DS)
  int64_t num_shared_experts = 0;
  int64_t first_k_dense_replace = 0;  // layers below it have a dense MLP
  bool tie_word_embeddings = false;
  // MLA (DeepSeek-V3, Kimi-K2).
  int64_t q_lora_rank = 0;
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  // quantization_config.weight_block_size[0] of FP8 block-scaled
  // checkpoints (128), 0 when the checkpoint is not block-quantized.
  int64_t fp8_block = 0;
  // Qwen-MoE: every decoder_sparse_step-th layer is MoE (1: all), except
  // the layers in mlp_only_layers.
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  std::string torch_dtype;  // "bfloat16", "float16", "float32"; "" absent

  bool is_moe() const { return num_experts > 0; }
  bool is_mla() const { return kv_lora_rank > 0; }
};

// One loaded schema file.
struct ModelSchema {
  std::string name;  // "llama-3.1-8b"
  ModelConfig config;
  ModelSpec spec;  // expanded, BuildIndex() done
  // Totals the file declares, for cross-checks (-1 when absent).
  int64_t declared_num_tensors = -1;
  int64_t declared_total_bytes = -1;
};

struct SchemaOptions {
  // DeepSeek-V3's checkpoint also holds an MTP layer (model.layers.61),
  // listed apart in `mtp_tensors` and left out of the declared totals.
  // When included, its tensors come after all the others.
  bool include_mtp = false;
};

// Loads and expands one schema file. Errors (NOT_FOUND for a missing file,
// INVALID_ARGUMENT otherwise) name the file and the offending field.
absl::StatusOr<ModelSchema> LoadModelSchema(const std::string& path,
                                            const SchemaOptions& options = {});

// Loads `<models dir>/<name>.json`, the directory found by FindModelsDir().
absl::StatusOr<ModelSchema> LoadNamedModelSchema(
    absl::string_view name, const SchemaOptions& options = {});

// A Hugging Face config.json's text (architectures[0] and the fields
// above). INVALID_ARGUMENT naming `where` and the field.
absl::StatusOr<ModelConfig> ParseHfConfig(absl::string_view json_text,
                                          const std::string& where);

// Bytes the parameters occupy in their stored dtypes.
int64_t TotalBytes(const ModelSpec& spec);
// Bytes of one parameter. REQUIRES: a validated shape.
int64_t ParamBytes(const ParamSpec& param);

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_MODEL_SCHEMA_H_
