// The demo's model: a Llama-style checkpoint from shared/models, scaled
// down (core/models/scaled_model.h), so that demo_trainer and demo_engine
// agree on names, dtypes and shapes without talking to each other.
#ifndef FERRY_EXAMPLES_DEMO_DEMO_MODEL_H_
#define FERRY_EXAMPLES_DEMO_DEMO_MODEL_H_

#include <string>

#include "absl/status/statusor.h"
#include "core/models/model_schema.h"

namespace ferry {

// `scale`: "demo" (DemoScale: about 1.73 GB of bf16 for llama-3.1-8b),
// "small" (2 layers, hidden 256, 8 heads of 32, 4 kv heads, vocab 4096:
// about 4 MB, for tests), "tiny" (1 layer of "small", vocab 512), or "full"
// (the checkpoint as it is). INVALID_ARGUMENT for another name.
absl::StatusOr<ModelSchema> LoadDemoModel(const std::string& model_name,
                                          const std::string& scale);

}  // namespace ferry

#endif  // FERRY_EXAMPLES_DEMO_DEMO_MODEL_H_
