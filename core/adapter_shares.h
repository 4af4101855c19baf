// Adapter shares: which part of each LoRA tensor an engine rank receives.
//
// A LoRA adapter (PEFT naming: "<module>.lora_A.weight" [r, in] and
// "<module>.lora_B.weight" [out, r], optionally under "base_model.model.")
// adds B·A to the base layer "<module>.weight" [out, in]. An engine rank
// holds a box of that base weight (rows of a column-parallel layer,
// columns of a row-parallel one, its rows of each fused part of qkv_proj or
// gate_up_proj, everything of a replicated one); the adapter's share that
// goes with it is then lora_B's rows of the box and lora_A's columns of the
// box, each with all r of its rank dimension. That is how the engines
// shard adapters (vLLM's slice_lora_a / slice_lora_b), derived here from
// the base layer's own layout rather than from layer names, so a fused or
// GQA-replicated layer needs no rule of its own.
//
// Where a rank holds the base weight as no single box (it reaches the
// engine whole, through its loader: a fallback parameter), the rank
// receives the adapter tensors whole and the engine slices them as it
// slices the layer.
//
// Pure: the daemon (daemon/lifecycle/adapters.h) builds the adapter's destination
// ranks from the result.
#ifndef FERRY_CORE_ADAPTER_SHARES_H_
#define FERRY_CORE_ADAPTER_SHARES_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/geometry.h"
#include "core/model_spec.h"
#include "core/piece.h"

namespace ferry {

// What ferry reads of an adapter's configuration (PEFT
// adapter_config.json): its rank and the modules it targets.
struct AdapterConfig {
  int64_t rank = 0;  // "r"; 0: not given (the tensors tell)
  // "target_modules" as a list of module names (the last component, as
  // PEFT matches them: "q_proj"); empty: not given as a list.
  std::vector<std::string> target_modules;
};

// One adapter tensor's share on one engine rank.
struct AdapterShare {
  int32_t tensor = -1;  // index into the adapter's tensors
  Box box;              // of the adapter tensor, elements
  bool whole = false;   // the base layer is not one box on this rank
};

// The adapter's shares, by TP rank of the instance, each list in the
// adapter's tensor order.
struct AdapterSharePlan {
  std::vector<std::vector<AdapterShare>> ranks;
  int64_t rank = 0;  // r, as the tensors have it
};

// Plans the shares of `adapter` (the adapter stream's tensors) for an
// instance whose ranks hold `base_ranks` of `base` (PlannedInstance
// layouts: model indices; pieces in staging are fallback tensors).
// INVALID_ARGUMENT, naming the adapter and the tensor: a tensor that is not
// a LoRA tensor, a module the base model has no 2-D weight for, a module
// the config's target_modules does not name (or a target module with no
// tensor), shapes that do not match the base weight ([r, in] and
// [out, r]), a module with lora_A and no lora_B or the reverse, ranks that
// differ between tensors or from the config's r, an r larger than the base
// weight's smaller dim.
absl::StatusOr<AdapterSharePlan> PlanAdapterShares(
    const std::string& adapter_name, const std::vector<ParamSpec>& adapter,
    const ModelSpec& base, const std::vector<RankLayout>& base_ranks,
    const AdapterConfig& config);

// The base module a LoRA tensor name targets ("model.layers.0.self_attn.
// q_proj") and which matrix it is; false for a name that is not one.
bool ParseLoraName(const std::string& name, std::string* module, bool* is_a);

}  // namespace ferry

#endif  // FERRY_CORE_ADAPTER_SHARES_H_
