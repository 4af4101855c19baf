// What a checkpoint parameter is, read from its Hugging Face name: the role
// that decides how trainers and engines shard it. Names follow
// LlamaForCausalLM, Qwen3MoeForCausalLM and DeepseekV3ForCausalLM; anything
// else is kOther, which both layouts replicate (always correct, never
// cheapest).
#ifndef FERRY_CORE_MODELS_PARAM_ROLE_H_
#define FERRY_CORE_MODELS_PARAM_ROLE_H_

#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace ferry {

enum class ParamKind : uint8_t {
  kEmbedding,  // model.embed_tokens
  kLmHead,     // lm_head
  kNorm,       // any *norm (RMSNorm weights, q_norm/k_norm, MLA norms)
  kQProj,
  kKProj,
  kVProj,
  kOProj,
  kGateProj,  // dense MLP, or a shared expert (see shared_expert)
  kUpProj,
  kDownProj,
  kRouter,  // mlp.gate and its e_score_correction_bias
  kExpertGate,
  kExpertUp,
  kExpertDown,
  kQAProj,   // MLA q_a_proj (down projection)
  kKVAProj,  // MLA kv_a_proj_with_mqa (down projection)
  kQBProj,   // MLA q_b_proj (up projection)
  kKVBProj,  // MLA kv_b_proj (up projection)
  kOther,
};

struct ParamRole {
  ParamKind kind = ParamKind::kOther;
  int64_t layer = -1;   // N of model.layers.N, else -1
  int64_t expert = -1;  // E of experts.E, else -1
  bool shared_expert = false;
  bool is_scale = false;  // an FP8 weight_scale_inv, of `module`.weight
  bool is_bias = false;   // `module`.bias
  std::string module;     // the name without its last component
};

ParamRole ClassifyParam(absl::string_view name);

// Column-parallel in Megatron and vLLM: the output dim (0) is split.
bool IsColumnParallel(ParamKind kind);
// Row-parallel: the input dim (1) is split.
bool IsRowParallel(ParamKind kind);
bool IsRoutedExpert(ParamKind kind);

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_PARAM_ROLE_H_
