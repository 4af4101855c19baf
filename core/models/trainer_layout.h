// Synthetic trainer layouts: what each rank of a Megatron-style (TP x PP x
// DP x EP) or FSDP trainer holds, as pieces. Tests, the demo and the
// benchmarks use them as the source side of a plan; no trainer runs here.
//
// Megatron conventions (rank = tp_rank + tp * (dp_rank + dp * pp_rank)):
// - column-parallel q/k/v/gate/up (and MLA q_b/kv_b, shared experts' gate/
//   up) split dim 0; row-parallel o_proj/down_proj split dim 1; the
//   embedding and lm_head are vocab-parallel (dim 0, padded to a multiple of
//   128 * tp as Megatron's make_vocab_size_divisible_by does); norms, router
//   gates and everything unrecognised are replicated;
// - a dim that does not divide by tp gives the first ranks ceil and the rest
//   floor; q/k/v split on whole heads; k/v with fewer heads than tp ranks
//   are replicated over groups of ranks (rank r holds head r*kv/tp);
// - PP splits the layers into contiguous stages (first stages get one more
//   when uneven); the embedding is on the first stage, the final norm and
//   lm_head on the last (tied embeddings: a copy of the embedding on the
//   last stage too, as Megatron keeps one);
// - DP ranks hold identical replicas;
// - routed experts are expert-parallel over `ep` ranks inside the tp*dp
//   ranks of a stage (ep rank = (tp_rank + tp*dp_rank) % ep), each expert
//   whole on one rank of its EP group, replicated over the groups;
// - FP8 block-scaled weights split only on whole 128-row/col blocks, and
//   their weight_scale_inv along the same dim on the matching scale rows;
//   a weight with fewer blocks than tp ranks stays replicated with its scale.
// Buffer 0 of each rank holds its local tensors in checkpoint order, each
// contiguous and 256-byte aligned.
#ifndef FERRY_CORE_MODELS_TRAINER_LAYOUT_H_
#define FERRY_CORE_MODELS_TRAINER_LAYOUT_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/models/model_schema.h"
#include "core/piece.h"

namespace ferry {

struct TrainerParallelism {
  int tp = 1;
  int pp = 1;
  int dp = 1;
  int ep = 1;  // must divide tp * dp
  // FSDP (ZeRO-3 with one flat parameter): every parameter flattened and
  // concatenated in checkpoint order, the flat buffer split evenly over all
  // tp * pp * dp ranks (the axes then only set the world size).
  bool fsdp = false;
  // Megatron's fused `linear_qkv`: per local kv group, its q heads, then its
  // k head, then its v head, in one local tensor. Needs kv heads >= tp.
  bool fused_qkv = false;
  int ranks_per_node = 8;
  std::string node_prefix = "train-";  // node of rank r: prefix + r/8
};

// One layout per trainer rank, indexed by global rank. INVALID_ARGUMENT for
// a parallelism the model cannot take (non-positive sizes, ep not dividing
// tp*dp, fused qkv with fewer kv heads than tp ranks).
absl::StatusOr<std::vector<RankLayout>> BuildTrainerLayout(
    const ModelSpec& model, const ModelConfig& config,
    const TrainerParallelism& parallelism);

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_TRAINER_LAYOUT_H_
