// StagingArea: daemon-owned shared memory where one destination rank's
// fallback tensors are assembled (docs/api.md, "Staging").
//
// Role: a fallback tensor (a whole checkpoint tensor the engine's own loader
// consumes) is written by the transfer into a staging region, one region per
// tensor, created with SharedMemoryRegion::Create (/dev/shm, mode 0600). The
// APPLY event names each region (id >= 2^31, shm name, size); the client
// maps it once and reads its tensors. An id always names the same memory: a
// region that a new plan no longer needs is released (and so disappears from
// the next APPLY), and a new one gets a new id.
//
// A GPU destination rank's staging is, by default, the same host shared
// memory, pinned (DeviceMemory::PinHost) so that the GPU copy kernels
// write it directly; the rank's loader reads it like a host rank's. A GPU
// rank that asked for device staging (StagingPlacement DEVICE) gets GPU
// memory on its own GPU instead (DeviceMemory::AllocateExported), exported
// as a cuda_ipc region: the loader then copies device to device, and the
// fallback bytes never cross PCIe twice. Both count against the staging
// limit alike.
//
// Names: every staging segment of this process is
// /dev/shm/ferry-staging-<owner>.<hint>-..., where <owner> is
// "<pid>.<8 hex digits>", fixed per process, and the process holds an
// exclusive flock on /dev/shm/ferry-staging-<owner>.lock for its lifetime
// (taken before its first segment exists). A ferryd that was killed leaves
// its segments behind; the next one to start removes every segment whose
// owner's lock is free (RemoveStaleStaging). A lock rather than the pid:
// processes in other pid namespaces (containers, sandboxed tests) share
// /dev/shm with different pids, and a dead pid may be a live one there.
//
// Owner: the VersionCoordinator, one per destination participant, as a
// shared_ptr so that a transfer in flight keeps the memory alive. Threading:
// Reserve runs under the coordinator's lock while no transfer of the rank
// is running; the memory is then written by the transfer worker alone.
#ifndef FERRY_DAEMON_MEMORY_STAGING_AREA_H_
#define FERRY_DAEMON_MEMORY_STAGING_AREA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "proto/ferry/v1/types.pb.h"
#include "transport/device_memory.h"
#include "transport/shared_memory.h"

namespace ferry {

class StagingArea {
 public:
  // `name_hint` goes into the shm names ("vllm-0.1"). `devices` non-null
  // (not owned): with `gpu` < 0 every slot is host memory pinned with it
  // as it is created; with `gpu` >= 0 every slot is GPU memory on that GPU.
  explicit StagingArea(std::string name_hint, DeviceMemory* devices = nullptr,
                       int gpu = -1);
  StagingArea(const StagingArea&) = delete;
  StagingArea& operator=(const StagingArea&) = delete;

  struct Slot {
    uint32_t region_id = 0;  // has kStagingBufferBit
    int64_t bytes = 0;
    std::optional<SharedMemoryRegion> host;  // host staging
    // Declared after `host`, so unpinned before it is unmapped.
    std::unique_ptr<PinnedHost> pinned;
    std::unique_ptr<ExportedDeviceBuffer> device;  // device staging

    // The first byte (a device address for device staging: kernels only).
    uint8_t* data() const { return device ? device->data() : host->data(); }
    // The daemon's ordinal of the GPU that holds it; -1: host memory.
    int gpu() const { return device ? device->gpu() : -1; }
  };

  // Keeps exactly one region per (parameter, bytes) in `needs`, creating
  // missing ones and releasing the rest. RESOURCE_EXHAUSTED when shared
  // memory cannot be created or pinned; the area is then unchanged for the
  // slots that existed.
  absl::Status Reserve(
      const std::vector<std::pair<std::string, int64_t>>& needs);

  // Bytes of every slot held now.
  int64_t reserved_bytes() const;
  // Bytes Reserve(needs) would create anew (needs not held at their size).
  int64_t NewBytes(
      const std::vector<std::pair<std::string, int64_t>>& needs) const;

  // Whether slots are host memory pinned for the GPUs.
  bool pinned() const { return devices_ != nullptr && gpu_ < 0; }
  // The GPU whose memory the slots are; -1: host memory.
  int gpu() const { return devices_ != nullptr ? gpu_ : -1; }

  // The slot of a parameter, or null.
  const Slot* Find(const std::string& parameter) const;

  // Every region, as the APPLY event lists them, sorted by id.
  std::vector<v1::MemoryRegion> Exported() const;

  // This process's staging name prefix, "ferry-staging-<owner>" (no '/'),
  // taking the owner lock on first use. Empty when the lock cannot be
  // taken (no /dev/shm): segments are then created without an owner and
  // are never removed by another ferryd.
  static const std::string& OwnerPrefix();

 private:
  const std::string name_hint_;
  DeviceMemory* const devices_;
  const int gpu_;
  std::string gpu_uuid_;  // of gpu_, as the APPLY names it
  std::map<std::string, Slot> slots_;  // by parameter

  absl::StatusOr<Slot> NewSlot(const std::string& param, int64_t bytes);
};

// Removes the staging segments (and lock files) in `dir` (/dev/shm) of
// every owner whose lock is free: ferryd processes that exited without
// cleaning up (kill -9, a crash). Leaves this process's own, those of
// owners that hold their lock, and anything not named like staging.
// Returns how many files it removed; `removed` (optional) gets their names.
int RemoveStaleStaging(const std::string& dir = "/dev/shm",
                       std::vector<std::string>* removed = nullptr);

}  // namespace ferry

#endif  // FERRY_DAEMON_MEMORY_STAGING_AREA_H_
