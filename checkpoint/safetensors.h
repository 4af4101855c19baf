// Hugging Face safetensors, read from the format's specification: an 8-byte
// little-endian header length N, N bytes of a JSON object (tensor name ->
// {"dtype", "shape", "data_offsets": [begin, end)} relative to the data
// that follows, plus an optional "__metadata__" of strings), then the data.
// A sharded checkpoint is a model.safetensors.index.json whose
// "weight_map" names, per tensor, the shard file (beside the index) that
// holds it.
//
// Checked: the header length against the file (and at most 100 MB, the
// format's own bound), JSON that parses into the expected types, a known
// dtype (F32, F16, BF16, F8_E4M3, F8_E5M2, I8, U8, I32, I64, BOOL), shapes
// of non-negative sizes, data_offsets inside the data and exactly the
// tensor's size, no two tensors sharing bytes; for an index, every shard
// present and every tensor found in the shard the index names.
#ifndef FERRY_CHECKPOINT_SAFETENSORS_H_
#define FERRY_CHECKPOINT_SAFETENSORS_H_

#include <string>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"

namespace ferry {

// One .safetensors file. INVALID_ARGUMENT naming the file, the tensor and
// the byte offset for anything malformed; the errors of MappedFile::Open.
absl::StatusOr<Checkpoint> ReadSafetensors(const std::string& path);

// A model.safetensors.index.json and the shards it names.
absl::StatusOr<Checkpoint> ReadSafetensorsIndex(const std::string& index_path);

}  // namespace ferry

#endif  // FERRY_CHECKPOINT_SAFETENSORS_H_
