#include "client/shared_tensor_arena.h"

#include <cstdio>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/explain.h"

namespace ferry {
namespace {

int64_t RoundUp(int64_t value, int64_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SharedTensorArena>> SharedTensorArena::Create(
    absl::string_view name_hint, int64_t capacity_bytes, uint32_t region_id,
    Backing backing) {
  if (capacity_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SharedTensorArena: capacity must be > 0 bytes, got ", capacity_bytes));
  }
  if (region_id & kStagingBufferBit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SharedTensorArena: region id ", region_id,
        " has the top bit set, which names daemon staging; use an id < 2^31"));
  }
  absl::StatusOr<SharedMemoryRegion> region =
      backing == Backing::kMemfd
          ? SharedMemoryRegion::CreateMemfd(capacity_bytes)
          : SharedMemoryRegion::Create(name_hint, capacity_bytes);
  if (!region.ok()) return region.status();
  return std::unique_ptr<SharedTensorArena>(
      new SharedTensorArena(*std::move(region), region_id, backing,
                            std::string(name_hint)));
}

SharedTensorArena::SharedTensorArena(SharedMemoryRegion region,
                                     uint32_t region_id, Backing backing,
                                     std::string name_hint)
    : region_(std::move(region)),
      capacity_(region_.size()),
      name_hint_(std::move(name_hint)),
      region_id_(region_id),
      backing_(backing) {}

void SharedTensorArena::Release() {
  absl::MutexLock lock(&mu_);
  SharedMemoryRegion gone = std::move(region_);  // unmapped and unlinked
}

absl::Status SharedTensorArena::Reallocate() {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<SharedMemoryRegion> region =
      backing_ == Backing::kMemfd
          ? SharedMemoryRegion::CreateMemfd(capacity_)
          : SharedMemoryRegion::Create(name_hint_, capacity_);
  if (!region.ok()) return region.status();
  region_ = *std::move(region);
  return absl::OkStatus();
}

absl::StatusOr<TensorSlot> SharedTensorArena::Allocate(int64_t bytes) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("SharedTensorArena: slot of ", bytes, " bytes"));
  }
  absl::MutexLock lock(&mu_);
  const int64_t offset = RoundUp(next_offset_, kTensorSlotAlignment);
  if (offset > capacity() || bytes > capacity() - offset) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "SharedTensorArena region ", region_id_, ": a slot of ",
        HumanBytes(bytes), " does not fit (", HumanBytes(next_offset_),
        " of ", HumanBytes(capacity()), " used)"));
  }
  next_offset_ = offset + bytes;
  return TensorSlot{offset, bytes, region_.data() + offset};
}

absl::StatusOr<TensorSlot> SharedTensorArena::SlotAt(int64_t byte_offset,
                                                     int64_t bytes) const {
  if (byte_offset < 0 || bytes < 0 || byte_offset > capacity() ||
      bytes > capacity() - byte_offset) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SharedTensorArena region ", region_id_, ": bytes [", byte_offset,
        ", +", bytes, ") are not inside its ", capacity(), " bytes"));
  }
  return TensorSlot{byte_offset, bytes, region_.data() + byte_offset};
}

int64_t SharedTensorArena::used() const {
  absl::MutexLock lock(&mu_);
  return next_offset_;
}

v1::MemoryRegion SharedTensorArena::Describe() const {
  v1::MemoryRegion out;
  out.set_region_id(region_id_);
  out.set_size_bytes(capacity());
  v1::SharedMemoryRegion* shm = out.mutable_shared_memory();
  shm->set_file_offset_bytes(0);
  if (backing_ == Backing::kMemfd) {
    // name() is "/proc/<pid>/fd/<n>" (transport/shared_memory.h).
    int pid = 0, fd = -1;
    if (std::sscanf(region_.name().c_str(), "/proc/%d/fd/%d", &pid, &fd) == 2) {
      shm->mutable_memfd()->set_pid(pid);
      shm->mutable_memfd()->set_fd(fd);
    }
  } else {
    shm->set_shm_name(region_.name());
  }
  return out;
}

}  // namespace ferry
