// checkpoint_fuzzer: the checkpoint readers (checkpoint/gguf.h,
// checkpoint/safetensors.h) on files made of fuzz bytes, then the TP split
// plan (checkpoint/tp_split.h) of whatever parses.
//
// The first byte picks the reader (even: GGUF, odd: safetensors) and the TP
// size; the rest is the file, written to a memfd that the reader maps by
// its /proc/self/fd path like any file.
//
// A reader promises an error or a checkpoint for any file; a crash,
// sanitizer report, hang or huge allocation is a bug, and so is a
// checkpoint whose tensors lie outside the file or overlap, or a split
// whose byte ranges leave the tensor.
#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "checkpoint/gguf.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tp_split.h"

namespace ferry {
namespace {

[[noreturn]] void Broken(const char* what) {
  std::fprintf(stderr, "checkpoint_fuzzer: invariant broken: %s\n", what);
  std::abort();
}

void Check(const Checkpoint& c, int tp) {
  for (const CheckpointTensor& t : c.tensors) {
    const int64_t size = c.files[t.file]->size();
    if (t.offset < 0 || t.bytes < 0 || t.offset > size - t.bytes) {
      Broken("a tensor outside its file");
    }
  }
  SplitOptions o;
  o.tp = tp;
  absl::StatusOr<std::vector<TensorSplit>> splits = PlanTpSplits(c, o);
  if (!splits.ok()) Broken("PlanTpSplits failed on a checkpoint that parsed");
  for (size_t i = 0; i < splits->size(); ++i) {
    const CheckpointTensor& t = c.tensors[i];
    for (const RankRanges& r : (*splits)[i].ranks) {
      for (const auto& [a, b] : r.byte_ranges) {
        if (a < t.offset || b > t.offset + t.bytes || a > b) {
          Broken("a rank's byte range outside its tensor");
        }
      }
    }
  }
}

}  // namespace
}  // namespace ferry

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const int fd = memfd_create("ckpt", MFD_CLOEXEC);
  if (fd < 0) return 0;
  size_t off = 1;
  while (off < size) {
    const ssize_t n = write(fd, data + off, size - off);
    if (n <= 0) break;
    off += static_cast<size_t>(n);
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  const int tp = 1 + (data[0] >> 1) % 8;
  if (data[0] % 2 == 0) {
    absl::StatusOr<ferry::GgufFile> g = ferry::ReadGguf(path);
    if (g.ok()) ferry::Check(g->checkpoint, tp);
  } else {
    absl::StatusOr<ferry::Checkpoint> c = ferry::ReadSafetensors(path);
    if (c.ok()) ferry::Check(*c, tp);
  }
  close(fd);
  return 0;
}
