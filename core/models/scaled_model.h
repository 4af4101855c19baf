// Scaled-down Llama-style models: the tensor set of a real checkpoint
// (Llama-3.1-8B) with fewer layers and smaller dims, so that the demo moves
// a 1-2 GB bf16 model with real names and real sharding structure.
#ifndef FERRY_CORE_MODELS_SCALED_MODEL_H_
#define FERRY_CORE_MODELS_SCALED_MODEL_H_

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/models/model_schema.h"

namespace ferry {

// New sizes; 0 keeps the base model's.
struct ModelScale {
  int64_t num_layers = 0;  // at most the base's: layers past it are dropped
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t vocab_size = 0;
};

// Llama-3.1-8B scaled to about 1.73 GB of bf16: 6 layers, hidden 2048,
// 16 heads of 128 (8 kv heads), intermediate 7168, the full 128256 vocab
// (so a real tokenizer still fits).
ModelScale DemoScale();

// The base's tensors, renamed nothing, reshaped to the scaled config, in the
// same order. INVALID_ARGUMENT for a base that is not Llama-style (MoE, MLA,
// a tensor it cannot reshape) or an inconsistent scale (heads not divisible
// by kv heads, more layers than the base). The result's declared totals are
// -1 and its name is "<base>-scaled".
absl::StatusOr<ModelSchema> ScaleModel(const ModelSchema& base,
                                       const ModelScale& scale);

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_SCALED_MODEL_H_
