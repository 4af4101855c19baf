// Command-line helpers shared by ferry's offline tools and benchmarks:
// parsing parallelism specs ("tp=4,pp=2,dp=2,ep=8,fsdp") and cutting a
// model down to its first N layers.
#ifndef FERRY_TOOLS_MODEL_ARGS_H_
#define FERRY_TOOLS_MODEL_ARGS_H_

#include <string>

#include "absl/status/statusor.h"
#include "core/models/engine_layout.h"
#include "core/models/model_schema.h"
#include "core/models/trainer_layout.h"

namespace ferry {

// "tp=4,pp=2,dp=2,ep=8" (any subset, any order; "fsdp" and "fused_qkv"
// as bare words).
absl::StatusOr<TrainerParallelism> ParseTrainerSpec(const std::string& spec);
// "tp=8" or "tp=16,ep" (expert parallel).
absl::StatusOr<EngineParallelism> ParseEngineSpec(const std::string& spec);

// Keeps the parameters outside "model.layers.N." and those of layers below
// `layers`, and sets config.num_layers. INVALID_ARGUMENT when `layers` is
// not in [1, num_layers].
absl::StatusOr<ModelSchema> FirstLayers(const ModelSchema& schema,
                                        int64_t layers);

}  // namespace ferry

#endif  // FERRY_TOOLS_MODEL_ARGS_H_
