// A checkpoint on disk as ferry sees it: files mapped read-only, and per
// tensor its name as the file spells it, dtype, row-major shape and the
// absolute byte range of its data in one of the files. The readers
// (safetensors.h, gguf.h) check everything a file says before anything
// uses it: every error names the file, the tensor and the byte offset.
//
// Threading: immutable once read; the mappings live as long as the
// Checkpoint.
#ifndef FERRY_CHECKPOINT_CHECKPOINT_H_
#define FERRY_CHECKPOINT_CHECKPOINT_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "checkpoint/mapped_file.h"
#include "core/dtype.h"
#include "core/geometry.h"

namespace ferry {

struct CheckpointTensor {
  std::string name;       // as the file names it ("blk.0.attn_q.weight")
  DType dtype = DType::kInvalid;
  std::string file_type;  // as the file says it: "BF16", "Q4_K"
  Dims shape;             // row-major, elements (GGUF's ne reversed)
  int32_t file = 0;       // index into Checkpoint::files
  int64_t offset = 0;     // absolute byte offset of its data in the file
  int64_t bytes = 0;      // length of its data
};

struct Checkpoint {
  std::vector<std::shared_ptr<const MappedFile>> files;
  std::vector<CheckpointTensor> tensors;  // in file order
  // safetensors "__metadata__"; GGUF key/values as text (gguf.h keeps them
  // typed).
  std::map<std::string, std::string> metadata;

  // Index into `tensors`, or -1.
  int32_t Find(absl::string_view name) const;
  // The tensor's bytes in its mapped file.
  const uint8_t* Data(const CheckpointTensor& t) const {
    return files[t.file]->data() + t.offset;
  }
};

// A safetensors file, a model.safetensors.index.json, or a GGUF file, told
// apart by the file's first bytes and name.
absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& path);

}  // namespace ferry

#endif  // FERRY_CHECKPOINT_CHECKPOINT_H_
