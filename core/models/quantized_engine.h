// FP8 in flight for an FP8 block-scaled model (DeepSeek-V3, Kimi-K2)
// whose trainer holds it in bf16 (docs/api.md, "Quantized in flight"):
// the trainer's model, and the engines' tables (BuildEngineTables,
// VllmTablesFromConfig over the FP8 checkpoint) with every FP8 weight
// declared quantized in flight. ferry.vllm_table(trainer_dtype="bf16")
// and ferry_plan --quantize_in_flight build on these.
#ifndef FERRY_CORE_MODELS_QUANTIZED_ENGINE_H_
#define FERRY_CORE_MODELS_QUANTIZED_ENGINE_H_

#include <cstdint>
#include <vector>

#include "core/layout_resolution.h"
#include "core/model_spec.h"

namespace ferry {

// The trainer of `fp8_checkpoint` when it holds it in `dtype` (bf16,
// f16 or f32): every FP8 parameter in `dtype`, and the scale tensors ("<weight>_scale_inv" of an FP8
// weight) gone.
ModelSpec TrainerOf(const ModelSpec& fp8_checkpoint,
                    DType dtype = DType::kBF16);

// `tables` as FP8 engines fed by that trainer: each FP8 weight whose rank
// has its "<name>_scale_inv" declared quantized in flight
// (EngineParam::fp8, `block` x `block`), its scales a plain parameter the
// quantizer fills. A weight the loader transforms (MLA's kv_b_proj) keeps
// its flag: it goes through the engine's loader quantized (a quantized
// fallback). Returns how many weights it declared.
int64_t DeclareQuantizedInFlight(int64_t block,
                                 std::vector<EngineTable>* tables);

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_QUANTIZED_ENGINE_H_
