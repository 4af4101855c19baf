// SharedTensorArena: the host memory a rank registers with ferryd.
//
// ferry registers allocations, not tensors (docs/api.md, "Memory
// registration"): a rank puts all its host tensors in one shared-memory
// region, registers the region once, and points its pieces (source) or
// engine parameters (destination) into it by byte offset. The arena is that
// region plus a bump allocator handing out 256-byte-aligned slots, so a
// caller never computes offsets by hand.
//
// Owner: the rank's process. Lifetime: the arena must outlive every client
// (SourceClient, DestinationClient) registered with it, because the daemon
// keeps the region mapped until deregistration; the arena unlinks its
// /dev/shm name when destroyed, after the client has deregistered.
//
// Threading: Allocate is thread-safe; the bytes themselves are plain memory
// that the caller synchronizes (ferry reads a source's bytes only during
// CommitVersion and writes a destination's only while it is paused).
#ifndef FERRY_CLIENT_SHARED_TENSOR_ARENA_H_
#define FERRY_CLIENT_SHARED_TENSOR_ARENA_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "proto/ferry/v1/types.pb.h"
#include "transport/shared_memory.h"

namespace ferry {

// Slots start on this boundary (what core/models' layouts assume, and what
// vectorized copies like).
constexpr int64_t kTensorSlotAlignment = 256;

// One slot of an arena: where it is in the region and in this process.
struct TensorSlot {
  int64_t byte_offset = 0;  // from the region's first byte (for pieces)
  int64_t size_bytes = 0;
  uint8_t* data = nullptr;  // valid while the arena lives

  absl::Span<uint8_t> bytes() const {
    return absl::Span<uint8_t>(data, static_cast<size_t>(size_bytes));
  }
};

class SharedTensorArena {
 public:
  enum class Backing {
    kPosixShm,  // /dev/shm/<name>, mode 0600; the daemon opens it by name
    kMemfd,     // sealed memfd; the daemon opens /proc/<pid>/fd/<n>
  };

  // Creates a region of `capacity_bytes` (> 0) that will be registered as
  // region `region_id` (< 2^31: ids with the top bit set are the daemon's
  // staging). `name_hint` ends up in the /dev/shm name, e.g.
  // "policy.rank3". Errors: INVALID_ARGUMENT for the arguments, the
  // SharedMemoryRegion error when the OS refuses (e.g. /dev/shm full).
  static absl::StatusOr<std::unique_ptr<SharedTensorArena>> Create(
      absl::string_view name_hint, int64_t capacity_bytes, uint32_t region_id,
      Backing backing = Backing::kPosixShm);

  SharedTensorArena(const SharedTensorArena&) = delete;
  SharedTensorArena& operator=(const SharedTensorArena&) = delete;

  // A fresh slot of `bytes` (>= 0) bytes, at the next 256-byte boundary.
  // RESOURCE_EXHAUSTED when the arena is full, naming the sizes.
  absl::StatusOr<TensorSlot> Allocate(int64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);

  // The slot at [byte_offset, byte_offset + bytes), for layouts that place
  // their tensors themselves (core/models' layouts do, 256-byte aligned).
  // INVALID_ARGUMENT when it is not inside the arena. Does not allocate.
  absl::StatusOr<TensorSlot> SlotAt(int64_t byte_offset, int64_t bytes) const;

  // Lifecycle.Offload (DestinationCallbacks::on_offload): lets go of the
  // memory: unmapped here and its /dev/shm name unlinked (a memfd closed),
  // so it is freed once the daemon unmapped it too. Slots keep their
  // offsets; their data pointers dangle until Reallocate.
  void Release() ABSL_LOCKS_EXCLUDED(mu_);
  // Lifecycle.Onload (on_onload): a fresh region of the same capacity and
  // backing (zeros, a new OS name); slots lie at data() + their offsets
  // again. Describe() names the new memory, for Registry.UpdateRegions.
  absl::Status Reallocate() ABSL_LOCKS_EXCLUDED(mu_);
  bool released() const { return region_.data() == nullptr; }

  // This arena as a MemoryRegion for RegisterSource / RegisterDestination.
  v1::MemoryRegion Describe() const;

  uint32_t region_id() const { return region_id_; }
  uint8_t* data() const { return region_.data(); }
  int64_t capacity() const { return capacity_; }
  int64_t used() const ABSL_LOCKS_EXCLUDED(mu_);
  // The OS name of the region (/dev/shm name or /proc/<pid>/fd/<n>).
  const std::string& os_name() const { return region_.name(); }

 private:
  SharedTensorArena(SharedMemoryRegion region, uint32_t region_id,
                    Backing backing, std::string name_hint);

  // Replaced only by Release and Reallocate, which the offload protocol
  // calls while nothing reads the arena (the rank is paused).
  SharedMemoryRegion region_;
  const int64_t capacity_;
  const std::string name_hint_;
  const uint32_t region_id_;
  const Backing backing_;
  mutable absl::Mutex mu_;
  int64_t next_offset_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry

#endif  // FERRY_CLIENT_SHARED_TENSOR_ARENA_H_
