// Synthetic inference-engine parameter tables, as vLLM allocates them for a
// checkpoint at a given TP size. Tests, the demo and the benchmarks feed
// them to ResolveDestinationLayout (core/layout_resolution.h) as the
// destination side of a plan; no engine runs here.
//
// vLLM conventions, per TP rank:
// - self_attn.qkv_proj (kFused q,k,v along dim 0): q heads split by tp; kv
//   heads split when tp <= kv heads, else each rank holds one kv head
//   (head r*kv/tp), so local rows = head_dim * (heads/tp + 2*max(1, kv/tp));
//   replicated k/v parts carry their local_extent (one head of rows);
// - mlp.gate_up_proj (kFused gate, up along dim 0), o_proj / down_proj
//   (kRow, dim 1), embed_tokens / lm_head (kVocabParallel, vocab padded to
//   a multiple of 64 and split evenly), norms and router gates kReplicated;
// - MoE: mlp.experts.w13_weight [E_local, 2*I/tp, H], kFused with gate then
//   up per expert (lead_index {e}); mlp.experts.w2_weight [E_local, H, I/tp],
//   kFused with one down_proj part per expert, shard_dim 1. With expert
//   parallelism each rank holds E/tp whole experts (experts r*E/tp ...),
//   whose parts carry local_extent = the whole part.
// - FP8 block-scaled checkpoints (DeepSeek-V3, Kimi-K2): every FP8 weight
//   has a live `weight_scale_inv` (`w13_weight_scale_inv`, ...) sharded like
//   its weight in scale rows. MLA: q_a_proj / kv_a_proj_with_mqa and the MLA
//   norms are replicated, q_b_proj column-parallel, o_proj row-parallel;
//   kv_b_proj is flagged kFlagTransformed (vLLM's MLA splits it into W_UK /
//   W_UV after loading, so it must go through the engine's loader).
// vLLM refuses sizes that do not divide by tp; so does this (an error).
// Buffer 0 of each rank holds its live parameters in checkpoint order,
// each contiguous and 256-byte aligned.
#ifndef FERRY_CORE_MODELS_ENGINE_LAYOUT_H_
#define FERRY_CORE_MODELS_ENGINE_LAYOUT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout_resolution.h"
#include "core/models/model_schema.h"

namespace ferry {

struct EngineParallelism {
  int tp = 1;
  bool expert_parallel = false;  // experts whole, E/tp per rank
  // Rank r runs on node `node_prefix + (first_device + r) / ranks_per_node`;
  // first_device places several instances side by side on a fleet.
  int ranks_per_node = 8;
  int first_device = 0;
  std::string node_prefix = "infer-";
};

// One table per TP rank, by rank. INVALID_ARGUMENT (naming the parameter
// and the size) where vLLM would refuse the model at this TP size.
absl::StatusOr<std::vector<EngineTable>> BuildEngineTables(
    const ModelSpec& model, const ModelConfig& config,
    const EngineParallelism& parallelism);

// vLLM's padded vocabulary: a multiple of 64; where that does not divide by
// tp (vLLM would refuse), a multiple of 64 * tp.
int64_t EnginePaddedVocab(int64_t vocab, int tp);

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_ENGINE_LAYOUT_H_
