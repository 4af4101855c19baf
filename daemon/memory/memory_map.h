// MemoryMap: the memory regions one participant registered, mapped once.
//
// Role: at registration the daemon opens every MemoryRegion a client names
// (a POSIX shm name or a memfd through /proc/<pid>/fd/<fd>) with
// SharedMemoryRegion and keeps it mapped until the participant is removed.
// Mapping includes setting up this process's page tables for every page
// (prefaulting, read-only touches), so the cost of first touch is paid once
// at registration instead of inside the first version's transfer.
// Pieces and engine parameters then refer to regions by the client's id;
// core/ refers to them by dense buffer index (0..n-1, regions sorted by id),
// because core's RankLayout::buffer_bytes is indexed by buffer.
//
// What a region must be (id, size, memory named) and where a source's
// pieces must lie are core's rules (core/registration_rules.h), run before
// Map; an engine parameter is checked against its region here (CheckRange),
// with a message that names the client's region id.
//
// Owner: the Participant (shared_ptr, so a transfer that is copying keeps
// the mapping alive even if the participant is removed meanwhile).
// Threading: immutable after Map(); the memory itself is plain bytes that
// only the transfer worker of its instance writes.
#ifndef FERRY_DAEMON_MEMORY_MEMORY_MAP_H_
#define FERRY_DAEMON_MEMORY_MEMORY_MAP_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/piece.h"
#include "proto/ferry/v1/types.pb.h"
#include "transport/device_memory.h"
#include "transport/shared_memory.h"

namespace ferry {

// How MemoryMap::Map treats the regions it checks.
struct MapOptions {
  // False: the coordinator, for a registration a member forwarded (the
  // memory is on the member's node): the regions are checked and their ids,
  // sizes and kinds kept, but nothing is opened; base() is null.
  bool map_memory = true;
  // Maps CUDA IPC regions; null: a CUDA region is FAILED_PRECONDITION.
  DeviceMemory* devices = nullptr;
  // Whose rights shared memory is opened with (the registering caller's);
  // a region it could not open itself is PERMISSION_DENIED.
  RegionAccess access;
};

class MemoryMap {
 public:
  // Maps every region: shared memory with mmap (prefaulted), CUDA IPC
  // regions through options.devices. `who` names the participant in
  // messages ("source policy rank 3"). REQUIRES: the regions passed core's
  // CheckRegions. INVALID_ARGUMENT for a region of a malformed kind (shm
  // name, page offset, IPC handle) or one that cannot be opened or mapped;
  // FAILED_PRECONDITION for a CUDA region where there are no GPUs;
  // PERMISSION_DENIED for memory the caller (options.access) could not
  // open; RESOURCE_EXHAUSTED for a region whose pages are not all backed.
  static absl::StatusOr<std::unique_ptr<MemoryMap>> Map(
      const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions,
      absl::string_view who, const MapOptions& options = {});

  // Host memory of the daemon's own, zeroed, one buffer per size (index =
  // region id), owned by the map: a source only ferryd writes (FP8 in
  // flight's quantizer ranks, daemon/plans/fp8_quantizer.h).
  static std::unique_ptr<MemoryMap> OwnedHost(const std::vector<int64_t>& sizes);
  // Host memory of that kind on another daemon (a member's quantizer
  // rank, as the coordinator plans it): sizes only, nothing mapped here.
  static std::unique_ptr<MemoryMap> HostElsewhere(
      const std::vector<int64_t>& sizes);

  MemoryMap(const MemoryMap&) = delete;
  MemoryMap& operator=(const MemoryMap&) = delete;
  ~MemoryMap();

  // Which mapped host region of which live MemoryMap holds `address`, as
  // "<who>: region <id> (byte <offset> of <bytes>)"; "" when none does
  // (daemon staging, a relay's memory, or no mapping at all). A copy that
  // faulted reports only the address (memory_fault_guard.h); this names
  // the client whose memory went away. Thread-safe.
  static std::string DescribeAddress(uintptr_t address);

  bool mapped() const { return mapped_; }
  // Unique among the maps of this process, never reused: a key for what
  // outlives a map's address (DeltaShadows' shadows).
  uint64_t serial() const { return serial_; }
  // Lifecycle.Offload: unmaps every region now (unpinned first), so that
  // the memory is freed once the client lets go of it too, however long
  // plans and runs keep this map. base() is null afterwards.
  // REQUIRES: nothing copies through this map, now or later (its instance
  // is offloaded: it takes part in no version and serves no peer).
  void Release() const;
  bool released() const { return released_.load(); }
  // Dense buffer index of a client region id, or -1.
  int32_t IndexOf(uint32_t region_id) const;
  size_t size() const { return ids_.size(); }
  uint32_t region_id(size_t index) const { return ids_[index]; }
  // The region's first byte: a host address, or for a region on_device()
  // a device address that only a GPU CopyEngine may touch.
  uint8_t* base(size_t index) const { return bases_[index]; }
  // Whether the region is GPU memory (a CUDA IPC region), and the daemon's
  // ordinal of its GPU (-1 for host memory or when not mapped here).
  bool on_device(size_t index) const { return gpus_[index] != kHostMemory; }
  int gpu(size_t index) const { return std::max(gpus_[index], -1); }
  // Whether any region is GPU memory.
  // The GPU of the first region in device memory (a GPU rank's own GPU,
  // where its device staging goes); -1 when none is.
  int first_gpu() const;
  bool any_on_device() const;

  // Pins host region `index` for the GPUs' kernels (DeviceMemory::PinHost),
  // once: later calls return at once.
  // The pin lives as long as the map. Thread-safe.
  absl::Status PinForGpus(size_t index, DeviceMemory* devices) const;
  bool pinned(size_t index) const;
  int64_t bytes(size_t index) const { return sizes_[index]; }
  // Sizes by dense index (core's RankLayout::buffer_bytes).
  const std::vector<int64_t>& sizes() const { return sizes_; }
  // Client region ids by dense index (core's RankLayout::buffer_ids).
  const std::vector<uint32_t>& ids() const { return ids_; }
  int64_t total_bytes() const;

  // INVALID_ARGUMENT unless region `region_id` exists and
  // [offset, offset + length) lies inside it. `what` names the thing placed
  // ("piece of model.x.weight box [0:4, 0:8]").
  absl::Status CheckRange(uint32_t region_id, int64_t offset, int64_t length,
                          absl::string_view who, absl::string_view what) const;

 private:
  MemoryMap() = default;

  // gpus_ value of host memory; a device region not mapped here is -1.
  static constexpr int kHostMemory = -2;

  static uint64_t NextSerial() {
    static std::atomic<uint64_t> next{1};
    return next.fetch_add(1);
  }
  const uint64_t serial_ = NextSerial();
  std::vector<uint32_t> ids_;  // sorted; index = dense buffer index
  mutable std::vector<SharedMemoryRegion> regions_;
  // By index; declared after regions_, so unpinned before they are unmapped.
  mutable absl::Mutex pin_mu_;
  mutable std::vector<std::unique_ptr<PinnedHost>> pins_
      ABSL_GUARDED_BY(pin_mu_);
  // pinned(i), read without the lock on every copy.
  std::unique_ptr<std::atomic<bool>[]> pinned_;
  mutable std::vector<std::unique_ptr<DeviceRegion>> device_regions_;
  std::vector<int> gpus_;
  mutable std::vector<uint8_t*> bases_;  // region start (after file_offset_bytes)
  std::vector<int64_t> sizes_;
  bool mapped_ = true;
  std::vector<std::unique_ptr<uint8_t[]>> owned_;  // OwnedHost's buffers
  // Release(): the map's contents are let go of, once, while nothing reads
  // them (its REQUIRES); `mutable` because holders share it as const.
  mutable std::atomic<bool> released_{false};
  // Whether the host regions are in DescribeAddress's index.
  bool indexed_ = false;
};

// If `s` is a copy's memory fault (memory_fault_guard.h FaultAddress), the
// same error naming the participant and region that holds the address
// (MemoryMap::DescribeAddress), or "daemon staging or a relay replica's
// memory"; any other status unchanged. Every data path (local copies, TCP
// channels, checksums) reports a client that shrank its memory this way.
absl::Status NameMemoryFault(const absl::Status& s);

}  // namespace ferry

#endif  // FERRY_DAEMON_MEMORY_MEMORY_MAP_H_
