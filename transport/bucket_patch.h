// A bucket's patch: delta versions (docs/architecture.md, "Delta
// versions"). When the destination's boxes hold the previous version of
// the bucket's bytes, only the 2-byte chunks that changed since need to
// travel; a patch says which and carries their new bytes, and the receiver
// writes them in place. The patch itself travels as an ordinary bucket of
// its own size (any channel kind; checksummed as any bucket is).
//
// The unit of change is a 2-byte chunk (a bf16 or f16 element; half an f32
// one), counted in the bucket's packed order (bucket_segments.h: boxes
// back to back, each row-major). A bucket is patchable when every box's
// unit is a whole number of chunks and starts on a chunk boundary of its
// buffer; FP8 and int8 boxes (1-byte units) go dense.
//
// Format, per box in bucket order:
//   u8   form: 1 = bitmap, 2 = index list
//   u64  n, the number of changed chunks (at most the box's chunks)
//   form 1: ceil(chunks / 8) bytes, bit j (LSB first) = chunk j changed
//   form 2: n x u32 chunk indices, strictly increasing
//   n x 2 bytes: the changed chunks' new bytes, in chunk order
// Integers little-endian. The sender picks, per box, the smaller form.
//
// Threading: plain functions.
#ifndef FERRY_TRANSPORT_BUCKET_PATCH_H_
#define FERRY_TRANSPORT_BUCKET_PATCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "transport/transport.h"

namespace ferry {

constexpr int64_t kPatchChunkBytes = 2;

// Which chunks of one box's source buffer changed since the version the
// destination holds: bit i of `bits` (LSB first in each word) is the
// chunk at byte 2i of the buffer that starts at `buffer_base`.
struct ChunkChanges {
  const uint8_t* buffer_base = nullptr;
  const uint64_t* bits = nullptr;
};

// Whether every box of `bucket` is patchable (above) given the buffers its
// boxes lie in (`buffer_bases`, by box; a null base: not patchable).
bool Patchable(const BucketView& bucket,
               const std::vector<const uint8_t*>& buffer_bases);

// What the patch of a bucket will be, from the bits alone (no client
// memory read): per box its changed chunks in packed order, the form, and
// the patch's size. `dense`: the patch would be `limit` bytes or more.
struct PatchPlan {
  bool dense = true;
  int64_t bytes = 0;
  int64_t changed_chunks = 0;  // of the bucket's bytes / 2
  std::vector<std::vector<uint64_t>> packed;  // by box
  std::vector<int64_t> counts;
  std::vector<uint8_t> forms;
};
// REQUIRES Patchable; `changes` by box.
PatchPlan PlanPatch(const BucketView& source,
                    const std::vector<ChunkChanges>& changes, int64_t limit);
// Writes the planned patch (plan.bytes into `out`), reading the changed
// chunks from `source`. REQUIRES !plan.dense. Allocates nothing: run it
// under the memory fault guard.
void WritePatch(const BucketView& source, const PatchPlan& plan, uint8_t* out);

// A received patch, checked against the destination's boxes.
struct ParsedPatch {
  struct Box {
    uint8_t form = 0;
    int64_t count = 0;
    std::vector<uint64_t> bits;  // bitmap form
    int64_t index_at = 0;        // index form: where the indices start
    int64_t values_at = 0;
  };
  std::vector<Box> boxes;
};
// DATA_LOSS, naming `what`, for a patch that does not fit `destination`
// (a count or index out of range, indices not increasing, a size that does
// not add up). Touches no destination memory.
absl::StatusOr<ParsedPatch> ParsePatch(const BucketView& destination,
                                       const uint8_t* patch, int64_t bytes,
                                       const std::string& what);
// Writes a parsed patch into `destination` (its boxes hold the previous
// version). Allocates nothing: run it under the memory fault guard.
void ApplyPatch(const BucketView& destination, const ParsedPatch& parsed,
                const uint8_t* patch);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_BUCKET_PATCH_H_
