// DeltaShadows: what a sending daemon keeps of its sources' host buffers
// so that it can send patches (delta versions; docs/architecture.md,
// "Delta versions"; transport/bucket_patch.h).
//
// For each source buffer a route of this daemon read (a trainer rank's
// region, a relay replica's, a quantizer's), a copy of its bytes as of the
// last version a route read it in: the shadow, tagged with that version.
// The first route to read a buffer in a later version V diffs the buffer
// against its shadow, once, 2 bytes at a time, and so learns which chunks
// changed since the shadow's version S; the same pass brings the shadow
// to V. Every route of V then encodes patches from those bits, valid for
// a destination that holds S. The buffer cannot change while V is in
// flight (its trainer waits for the version, a replica is paused or done),
// so a shadow taken in V is the buffer as V sent it.
//
// Memory: each shadowed buffer's bytes plus 1/16 of them for the bits;
// at most `budget_bytes` in all (--delta_shadow_mb), least recently used
// shadows dropped to make room; a buffer that does not fit is sent dense.
// Time: one pass over each read buffer per version (read it and its
// shadow, write the chunks that changed), in slices on the planning
// threads (core/parallel_for.h).
//
// Threading: thread-safe; the diff of one buffer runs once per version
// under that shadow's own lock, others reading it wait for it.
#ifndef FERRY_DAEMON_TRANSFER_DELTA_SHADOWS_H_
#define FERRY_DAEMON_TRANSFER_DELTA_SHADOWS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "daemon/memory/memory_map.h"

namespace ferry {

class DeltaShadows {
 public:
  // `budget_bytes` 0: no shadows, every bucket dense.
  explicit DeltaShadows(int64_t budget_bytes);
  DeltaShadows(const DeltaShadows&) = delete;
  DeltaShadows& operator=(const DeltaShadows&) = delete;

  bool enabled() const { return budget_bytes_ > 0; }

  struct Changes {
    // The version the bits are relative to (what the shadow held before
    // `version`); 0: none, no patch from this buffer in this version.
    int64_t since = 0;
    // Bit i: the 2-byte chunk at byte 2i of the buffer changed since
    // `since`. Kept alive by the holder.
    std::shared_ptr<const std::vector<uint64_t>> bits;
    const uint8_t* buffer_base = nullptr;
  };
  // The changes of host buffer `index` of `map` in `version` (computed by
  // the first caller of that version). since 0 for a buffer seen first, a
  // GPU or unmapped one, one over the budget, or a version that is not
  // after the shadow's (a stream that started over).
  Changes For(const MemoryMap* map, size_t index, int64_t version)
      ABSL_LOCKS_EXCLUDED(mu_);

  int64_t used_bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Shadow {
    absl::Mutex mu;
    int64_t version = 0;  // the shadow holds the buffer as of it
    int64_t since = 0;    // `bits` are the changes from `since` to it
    std::vector<uint8_t> bytes;
    std::shared_ptr<std::vector<uint64_t>> bits;
    const uint8_t* base = nullptr;
  };
  using Key = std::pair<uint64_t, size_t>;  // map serial, buffer index

  // The shadow of `key`, made (and room made for it) if needed; null when
  // it cannot fit.
  std::shared_ptr<Shadow> ShadowOf(const Key& key, int64_t bytes)
      ABSL_LOCKS_EXCLUDED(mu_);

  struct Entry {
    std::shared_ptr<Shadow> shadow;
    int64_t cost = 0;       // counted against the budget
    uint64_t last_use = 0;  // clock_ when last asked for
  };

  const int64_t budget_bytes_;
  mutable absl::Mutex mu_;
  std::map<Key, Entry> shadows_ ABSL_GUARDED_BY(mu_);
  uint64_t clock_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t used_bytes_ ABSL_GUARDED_BY(mu_) = 0;
};

// Which 2-byte chunks of `now` differ from `shadow` (n bytes each, n
// even), as bits; `shadow` takes `now`'s bytes where they differ. Exposed
// for its test and benchmark.
void DiffIntoShadow(const uint8_t* now, uint8_t* shadow, int64_t n,
                    uint64_t* bits);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_DELTA_SHADOWS_H_
