#include "checkpoint/checkpoint.h"

#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/gguf.h"
#include "checkpoint/safetensors.h"

namespace ferry {

int32_t Checkpoint::Find(absl::string_view name) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].name == name) return static_cast<int32_t>(i);
  }
  return -1;
}

absl::StatusOr<Checkpoint> OpenCheckpoint(const std::string& path) {
  if (absl::EndsWith(path, ".json")) return ReadSafetensorsIndex(path);
  absl::StatusOr<std::shared_ptr<const MappedFile>> f = MappedFile::Open(path);
  if (!f.ok()) return f.status();
  if ((*f)->size() >= 4 && std::memcmp((*f)->data(), "GGUF", 4) == 0) {
    absl::StatusOr<GgufFile> g = ReadGguf(path);
    if (!g.ok()) return g.status();
    return std::move(g->checkpoint);
  }
  return ReadSafetensors(path);
}

}  // namespace ferry
