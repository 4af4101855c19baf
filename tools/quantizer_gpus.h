// ferry_plan --quantize_in_flight: where the cluster model
// (core/cluster_model.h) puts FP8 in flight's quantizing.
#ifndef FERRY_TOOLS_QUANTIZER_GPUS_H_
#define FERRY_TOOLS_QUANTIZER_GPUS_H_

#include <cstddef>
#include <vector>

#include "core/fp8_sources.h"

namespace ferry {

// Where the cluster model (core/cluster_model.h) puts the quantizing:
// each node's quantizer rank of `fs` (AddFp8Sources over `trainer_ranks`
// trainer ranks) split over that node's trainer GPUs, each tensor in whole
// block rows over up to all of them as a TP shard would be, each part on
// that trainer rank's GPU (`gpu_of[i]`: the source whose GPU source i
// shares, -1 its own), as quantizing on the trainer's GPUs would place
// them. (ferryd quantizes in its host memory today; the model's "as ferryd
// runs it" counts one channel per pair of nodes either way.) The
// QuantizedParams' source_rank becomes -1: each is split.
void SpreadOverTrainerGpus(size_t trainer_ranks, Fp8Sources* fs,
                           std::vector<int>* gpu_of);

}  // namespace ferry

#endif  // FERRY_TOOLS_QUANTIZER_GPUS_H_
