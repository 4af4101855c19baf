// ferry_plan --quantize_in_flight: an FP8 block-scaled checkpoint
// (DeepSeek-V3, Kimi-K2) served by FP8 engines while the trainer holds it
// in bf16, as ferryd runs it (FP8 in flight, docs/api.md "Quantized in
// flight"): the trainer's model and the engines' tables that declare it.
// For modeling only (ferry_plan); ferryd takes the same declarations from
// the engines' registrations.
#ifndef FERRY_TOOLS_QUANTIZED_TRAINER_H_
#define FERRY_TOOLS_QUANTIZED_TRAINER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "core/fp8_sources.h"
#include "core/layout_resolution.h"
#include "core/model_spec.h"

namespace ferry {

// The trainer of `fp8_checkpoint` when it trains in bf16: every FP8
// parameter bf16, and the scale tensors ("<weight>_scale_inv" of an FP8
// weight) gone.
ModelSpec Bf16TrainerOf(const ModelSpec& fp8_checkpoint);

// `tables` (BuildEngineTables over the FP8 checkpoint) as FP8 engines fed
// by that trainer: each FP8 weight whose rank has its "<name>_scale_inv"
// declared quantized in flight (EngineParam::fp8, `block` x `block`), its
// scales a plain parameter the quantizer fills. Returns the weights whose
// loader transforms them after loading (kFlagTransformed: MLA's
// kv_b_proj), which ferryd cannot quantize in place yet (they need a
// quantized fallback, docs/api.md); they are modeled as if it could (the
// flag cleared): their bytes are about 0.05% of Kimi-K2's.
std::vector<std::string> DeclareQuantizedInFlight(
    int64_t block, std::vector<EngineTable>* tables);

// Where the cluster model (core/cluster_model.h) puts the quantizing:
// each node's quantizer rank of `fs` (AddFp8Sources over `trainer_ranks`
// trainer ranks) split into one per trainer rank of that node, the tensors
// dealt to the least loaded by bytes, each on that trainer rank's GPU
// (`gpu_of[i]`: the source whose GPU source i shares, -1 its own), as
// quantizing on the trainer's GPUs would place them. (ferryd quantizes
// in its host memory today; the model's "as ferryd runs it" counts one
// channel per pair of nodes either way.)
void SpreadOverTrainerGpus(size_t trainer_ranks, Fp8Sources* fs,
                           std::vector<int>* gpu_of);

}  // namespace ferry

#endif  // FERRY_TOOLS_QUANTIZED_TRAINER_H_
