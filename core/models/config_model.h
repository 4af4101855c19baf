// A checkpoint's tensor list from its Hugging Face config.json alone: the
// names, dtypes and shapes the checkpoint of that architecture holds, as
// the shared/models schema files list them (tested against every one of
// them). With it, an engine's tables follow from config.json and its
// TP / EP settings in one call (VllmTablesFromConfig), without a schema
// file.
//
// Architectures: LlamaForCausalLM (and MistralForCausalLM, the same
// layout), Qwen3ForCausalLM (q_norm / k_norm), Qwen3MoeForCausalLM (routed
// experts, mlp_only_layers, decoder_sparse_step), DeepseekV3ForCausalLM
// (MLA, dense layers below first_k_dense_replace, shared experts, FP8
// block-scaled weights with their weight_scale_inv when
// quantization_config.weight_block_size is set; Kimi-K2 uses it too).
#ifndef FERRY_CORE_MODELS_CONFIG_MODEL_H_
#define FERRY_CORE_MODELS_CONFIG_MODEL_H_

#include "absl/status/statusor.h"
#include "core/model_spec.h"
#include "core/models/engine_layout.h"
#include "core/models/model_schema.h"

namespace ferry {

// In checkpoint (module) order, BuildIndex() done. INVALID_ARGUMENT for an
// architecture not listed above (naming it) or a config missing a size.
absl::StatusOr<ModelSpec> ModelSpecFromConfig(const ModelConfig& config);

// vLLM's engine tables for a config.json's text at `parallelism` (TP, EP),
// one per TP rank (engine_layout.h): ParseHfConfig, ModelSpecFromConfig,
// BuildEngineTables. `spec` (optional) receives the checkpoint's tensors.
absl::StatusOr<std::vector<EngineTable>> VllmTablesFromConfig(
    absl::string_view config_json, const EngineParallelism& parallelism,
    ModelSpec* spec = nullptr);

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_CONFIG_MODEL_H_
