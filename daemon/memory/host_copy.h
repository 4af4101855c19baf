// HostCopy: an offloaded instance's weights, kept in ferryd's own memory
// (Lifecycle.Offload with keep_host_copy) so that Onload restores them
// without the trainer or a peer instance.
//
// What is copied is every registered region of every rank, byte for byte:
// the live parameters ferry writes directly, the ones the engine's loader
// fills (fallback), and whatever else the engine keeps there. Restore
// writes the same bytes into the regions the ranks allocated again (same
// ids and sizes; Registry.UpdateRegions), so the instance holds exactly
// the version it held when offloaded.
//
// Host regions are copied with memcpy into private anonymous memory; GPU
// regions with the GPU's copy engine into the same memory, pinned for it
// (device_memory.h).
//
// Owner: the VersionCoordinator (shared with the onload that reads it) for
// ranks on its node; a member's MemberMemory for ranks on the member's.
// Threading: Take and Restore run on the calling Lifecycle thread; a copy
// is immutable once taken.
#ifndef FERRY_DAEMON_MEMORY_HOST_COPY_H_
#define FERRY_DAEMON_MEMORY_HOST_COPY_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include <string>

#include "daemon/memory/memory_map.h"
#include "transport/device_memory.h"

namespace ferry {

// MemAvailable of /proc/meminfo in bytes (what a host copy may take); -1
// when it cannot be read.
int64_t AvailableHostMemory();

class HostCopy {
 public:
  // One rank's memory, as the daemon that maps it holds it.
  struct Rank {
    std::string id;   // participant id: matches a rank at Restore
    std::string who;  // "instance a tp rank 1", for messages
    std::shared_ptr<const MemoryMap> memory;
  };

  // Copies every region of `ranks` at `version`. `devices` copies GPU
  // regions (null: a GPU region is FAILED_PRECONDITION). `cancel` (may be
  // null) is checked between regions: CANCELLED. RESOURCE_EXHAUSTED when
  // memory for the copy cannot be had.
  static absl::StatusOr<std::unique_ptr<HostCopy>> Take(
      const std::vector<Rank>& ranks, int64_t version, DeviceMemory* devices,
      const std::atomic<bool>* cancel);

  HostCopy(const HostCopy&) = delete;
  HostCopy& operator=(const HostCopy&) = delete;
  ~HostCopy();

  // Writes the copy into the memory `ranks` hold now: the same participants
  // (by id), mapped, with the copy's region ids and sizes
  // (FAILED_PRECONDITION / INVALID_ARGUMENT naming the rank and region
  // otherwise, before any byte moves).
  absl::Status Restore(const std::vector<Rank>& ranks, DeviceMemory* devices,
                       const std::atomic<bool>* cancel) const;

  int64_t version() const { return version_; }
  int64_t bytes() const { return bytes_; }

 private:
  struct Region {
    uint32_t id = 0;
    int64_t bytes = 0;
    uint8_t* data = nullptr;  // mmap'ed, page aligned
    std::unique_ptr<PinnedHost> pin;  // for a GPU region's copy engine
  };
  HostCopy() = default;

  int64_t version_ = 0;
  int64_t bytes_ = 0;
  std::vector<std::string> ids_;            // participant ids, as taken
  std::vector<std::vector<Region>> ranks_;  // by ids_, regions by id
};

}  // namespace ferry

#endif  // FERRY_DAEMON_MEMORY_HOST_COPY_H_
