#include "daemon/memory/memory_map.h"

#include <errno.h>
#include <sys/mman.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/geometry.h"
#include "core/limits.h"
#include "transport/memory_fault_guard.h"

namespace ferry {
namespace {

constexpr int64_t kPageBytes = 4096;
// sizeof(cudaIpcMemHandle_t), CUDA_IPC_HANDLE_SIZE.
constexpr size_t kCudaIpcHandleBytes = 64;

absl::Status RegionError(absl::string_view who, uint32_t id,
                         absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(who, ": region ", id, ": ", what));
}

// Sets up this process's page tables for [data, data + bytes) now, so that
// the first version does not pay for them. Touching a page of a fresh
// mapping costs a fault even when the client already allocated it, and on
// virtualized hosts that is tens of microseconds per 4 KiB page (measured on
// the dev VM: a 1.7 GB demo model spent 23 s of its first transfer in them,
// then 0.13 s per version). MADV_POPULATE_READ fills the guest page tables
// in one call (Linux >= 5.14; EINVAL where unknown); the read of one byte
// per page then takes whatever per-page cost remains (shadow or nested page
// tables), split over a few threads for large regions. Reads only: a
// destination's live weights are not written outside a version.
//
// A page whose backing store is gone or cannot be had (the file was
// shrunk, or it is a hole of a sparse file on a full /dev/shm) would raise
// SIGBUS: MADV_POPULATE_READ says so with EFAULT, and the touches run
// guarded. Either way the result is RESOURCE_EXHAUSTED with the offset of
// the first such page, and the daemon lives on.
absl::Status PrefaultPages(const uint8_t* data, int64_t bytes) {
#ifndef MADV_POPULATE_READ
  constexpr int MADV_POPULATE_READ = 22;
#endif
  auto lost = [data, bytes](uintptr_t address) {
    const int64_t at = static_cast<int64_t>(
        address - reinterpret_cast<uintptr_t>(data));
    return absl::ResourceExhaustedError(absl::StrCat(
        "its memory is not backed from byte ",
        at >= 0 && at < bytes ? at : 0, " of ", bytes,
        " (a shared-memory file shrunk, or a sparse one larger than the "
        "free space of /dev/shm)"));
  };
  if (::madvise(const_cast<uint8_t*>(data), static_cast<size_t>(bytes),
                MADV_POPULATE_READ) != 0 &&
      errno == EFAULT) {
    return lost(reinterpret_cast<uintptr_t>(data));
  }
  auto touch = [data](int64_t begin, int64_t end) {
    return RunGuarded([&] {
      uint8_t sink = 0;
      for (int64_t at = begin; at < end; at += kPageBytes) {
        sink ^= *static_cast<const volatile uint8_t*>(data + at);
      }
      (void)sink;
    });
  };
  constexpr int64_t kPerThreadBytes = int64_t{256} << 20;
  const int64_t cores =
      std::max<int64_t>(1, std::thread::hardware_concurrency());
  const int64_t threads =
      std::min<int64_t>({4, cores, (bytes + kPerThreadBytes - 1) / kPerThreadBytes});
  std::vector<absl::Status> results(std::max<int64_t>(threads, 1));
  if (threads <= 1) {
    results[0] = touch(0, bytes);
  } else {
    const int64_t pages = (bytes + kPageBytes - 1) / kPageBytes;
    std::vector<std::thread> workers;
    for (int64_t t = 0; t < threads; ++t) {
      const int64_t begin = pages * t / threads * kPageBytes;
      const int64_t end =
          std::min(bytes, pages * (t + 1) / threads * kPageBytes);
      workers.emplace_back(
          [&results, &touch, t, begin, end] { results[t] = touch(begin, end); });
    }
    for (std::thread& w : workers) w.join();
  }
  for (const absl::Status& s : results) {
    if (!s.ok()) return lost(FaultAddress(s).value_or(0));
  }
  return absl::OkStatus();
}

// The fields of a CUDA IPC region; the allocation itself is checked when
// DeviceMemory maps it.
absl::Status CheckCudaIpcRegion(const v1::MemoryRegion& r,
                                absl::string_view who) {
  const v1::CudaIpcRegion& ipc = r.cuda_ipc();
  if (ipc.ipc_handle().size() != kCudaIpcHandleBytes) {
    return RegionError(who, r.region_id(),
                       absl::StrCat("ipc_handle is ", ipc.ipc_handle().size(),
                                    " bytes; a cudaIpcMemHandle_t is ",
                                    kCudaIpcHandleBytes));
  }
  int64_t end;
  if (ipc.allocation_offset_bytes() < 0 ||
      !CheckedAdd(ipc.allocation_offset_bytes(), r.size_bytes(), &end)) {
    return RegionError(
        who, r.region_id(),
        absl::StrCat("allocation_offset_bytes ", ipc.allocation_offset_bytes(),
                     " is negative or overflows with the size"));
  }
  if (ipc.device().kind() != v1::DEVICE_KIND_CUDA ||
      ipc.device().cuda_uuid().empty()) {
    return RegionError(who, r.region_id(),
                       "a cuda_ipc region needs device {kind: CUDA, "
                       "cuda_uuid} of the GPU that holds it");
  }
  return absl::OkStatus();
}

// Every live MemoryMap's mapped host regions by start address, for
// DescribeAddress: a fault names its client in O(log regions), whichever
// path faulted and whatever job it was running.
struct MappedRange {
  uintptr_t end;
  std::string who;
  uint32_t region_id;
};
struct AddressIndex {
  absl::Mutex mu;
  std::map<uintptr_t, MappedRange> ranges ABSL_GUARDED_BY(mu);
};
AddressIndex& Index() {
  static AddressIndex* index = new AddressIndex();  // never destroyed
  return *index;
}

}  // namespace

void MemoryMap::Release() const {
  if (released_.exchange(true)) return;
  if (indexed_) {
    AddressIndex& index = Index();
    absl::MutexLock lock(&index.mu);
    for (size_t i = 0; i < ids_.size(); ++i) {
      if (!on_device(i) && bases_[i] != nullptr) {
        index.ranges.erase(reinterpret_cast<uintptr_t>(bases_[i]));
      }
    }
  }
  {
    absl::MutexLock lock(&pin_mu_);
    for (auto& pin : pins_) pin.reset();  // unpinned before unmapped
    for (size_t i = 0; i < ids_.size(); ++i) pinned_[i].store(false);
  }
  device_regions_.clear();
  regions_.clear();
  for (uint8_t*& b : bases_) b = nullptr;
}

MemoryMap::~MemoryMap() {
  if (!indexed_ || released_.load()) return;
  AddressIndex& index = Index();
  absl::MutexLock lock(&index.mu);
  for (size_t i = 0; i < ids_.size(); ++i) {
    if (!on_device(i) && bases_[i] != nullptr) {
      index.ranges.erase(reinterpret_cast<uintptr_t>(bases_[i]));
    }
  }
}

std::string MemoryMap::DescribeAddress(uintptr_t address) {
  AddressIndex& index = Index();
  absl::MutexLock lock(&index.mu);
  auto it = index.ranges.upper_bound(address);
  if (it == index.ranges.begin()) return "";
  --it;
  if (address >= it->second.end) return "";
  return absl::StrCat(it->second.who, ": region ", it->second.region_id,
                      " (byte ", address - it->first, " of ",
                      it->second.end - it->first, ")");
}

absl::Status NameMemoryFault(const absl::Status& s) {
  if (s.ok()) return s;
  std::optional<uintptr_t> address = FaultAddress(s);
  if (!address.has_value()) return s;
  std::string where = MemoryMap::DescribeAddress(*address);
  if (where.empty()) where = "daemon staging or a relay replica's memory";
  return absl::FailedPreconditionError(absl::StrCat(
      where, ": the shared memory is no longer backed (SIGBUS in the copy: "
      "it was shrunk after registration); nothing else was harmed"));
}

namespace {

// Map, step 1 for a shared-memory region: its offset, and the name, memfd
// or path it is opened by.
absl::Status CheckSharedMemoryRegion(const v1::MemoryRegion& r,
                                     absl::string_view who,
                                     const MapOptions& options) {
  const v1::SharedMemoryRegion& shm = r.shared_memory();
  if (shm.file_offset_bytes() < 0 ||
      shm.file_offset_bytes() % kPageBytes != 0) {
    return RegionError(who, r.region_id(),
                       absl::StrCat("file_offset_bytes ",
                                    shm.file_offset_bytes(),
                                    " is not a non-negative multiple of ",
                                    kPageBytes));
  }
  int64_t end;
  if (!CheckedAdd(shm.file_offset_bytes(), r.size_bytes(), &end)) {
    return RegionError(who, r.region_id(), "file offset + size overflows");
  }
  if (shm.memory_case() == v1::SharedMemoryRegion::kShmName) {
    const std::string& name = shm.shm_name();
    if (name.size() < 2 || name[0] != '/' ||
        name.find('/', 1) != std::string::npos) {
      return RegionError(who, r.region_id(),
                         absl::StrCat("shm_name '", name,
                                      "' must be one leading '/' and no "
                                      "other '/', e.g. /ferry.policy.0"));
    }
  } else if (shm.memory_case() == v1::SharedMemoryRegion::kMemfd) {
    if (shm.memfd().pid() <= 0 || shm.memfd().fd() < 0) {
      return RegionError(who, r.region_id(),
                         "memfd needs a positive pid and a fd >= 0");
    }
  } else if (shm.memory_case() == v1::SharedMemoryRegion::kFilePath) {
    const std::string& path = shm.file_path();
    if (path.empty() || path[0] != '/') {
      return RegionError(who, r.region_id(),
                         absl::StrCat("file_path ", Quote(path),
                                      " must be an absolute path"));
    }
    if (options.map_memory && options.access.write) {
      return RegionError(who, r.region_id(),
                         "a file_path region is read-only: only sources "
                         "register files (a destination's memory is "
                         "written)");
    }
  } else {
    return RegionError(who, r.region_id(),
                       "shared_memory needs shm_name, memfd or file_path");
  }
  return absl::OkStatus();
}

// Map, step 1: one region's fields, checked before anything is mapped. Ids
// unique and below 2^31, sizes > 0, memory named: core's CheckRegions,
// which every caller runs first (REQUIRES).
absl::Status CheckRegion(const v1::MemoryRegion& r, absl::string_view who,
                         const MapOptions& options) {
  switch (r.memory_case()) {
    case v1::MemoryRegion::kCudaIpc:
      return CheckCudaIpcRegion(r, who);
    case v1::MemoryRegion::kSharedMemory:
      return CheckSharedMemoryRegion(r, who, options);
    default:  // refused by CheckRegions
      return absl::InternalError(absl::StrCat(
          who, ": region ", r.region_id(),
          " names no memory; CheckRegions must run first"));
  }
}

// Map, step 3 for a CUDA IPC region: the GPU allocation, opened through
// options.devices.
absl::StatusOr<std::unique_ptr<DeviceRegion>> MapDeviceRegion(
    const v1::MemoryRegion& r, absl::string_view who,
    const MapOptions& options) {
  absl::StatusOr<std::unique_ptr<DeviceRegion>> mapped =
      options.devices == nullptr
          ? absl::FailedPreconditionError(
                "GPU memory cannot be registered with this ferryd")
          : options.devices->Map(
                IpcRegion{r.cuda_ipc().ipc_handle(),
                          r.cuda_ipc().allocation_offset_bytes(),
                          r.cuda_ipc().device().cuda_uuid()},
                r.size_bytes());
  if (!mapped.ok()) {
    return absl::Status(
        mapped.status().code(),
        absl::StrCat(who, ": region ", r.region_id(), " (GPU ",
                     r.cuda_ipc().device().cuda_uuid(), "): ",
                     mapped.status().message()));
  }
  return mapped;
}

// Map, step 3 for a shared-memory region: the file mapped (by name, path
// or the client's memfd) and its pages prefaulted.
absl::StatusOr<SharedMemoryRegion> MapSharedMemory(const v1::MemoryRegion& r,
                                                   absl::string_view who,
                                                   const MapOptions& options) {
  const v1::SharedMemoryRegion& shm = r.shared_memory();
  const int64_t offset = shm.file_offset_bytes();
  const int64_t length = offset + r.size_bytes();
  absl::StatusOr<SharedMemoryRegion> opened =
      shm.memory_case() == v1::SharedMemoryRegion::kShmName
          ? SharedMemoryRegion::Open(shm.shm_name(), length, options.access)
      : shm.memory_case() == v1::SharedMemoryRegion::kFilePath
          ? SharedMemoryRegion::OpenFile(shm.file_path(), length,
                                         options.access)
          : SharedMemoryRegion::OpenByPath(
                absl::StrCat("/proc/", shm.memfd().pid(), "/fd/",
                             shm.memfd().fd()),
                length, options.access);
  if (!opened.ok()) {
    // Whose fault it is stays in the code: not the caller's to open
    // (PERMISSION_DENIED), no room for it (RESOURCE_EXHAUSTED), else a
    // region that is not what the registration says.
    const absl::StatusCode code =
        opened.status().code() == absl::StatusCode::kPermissionDenied ||
                opened.status().code() ==
                    absl::StatusCode::kResourceExhausted
            ? opened.status().code()
            : absl::StatusCode::kInvalidArgument;
    return absl::Status(code, absl::StrCat(who, ": region ", r.region_id(),
                                           ": cannot be mapped: ",
                                           opened.status().message()));
  }
  if (absl::Status s = PrefaultPages(opened->data() + offset, r.size_bytes());
      !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(who, ": region ",
                                               r.region_id(), ": ",
                                               s.message()));
  }
  return opened;
}

}  // namespace

std::unique_ptr<MemoryMap> MemoryMap::OwnedHost(
    const std::vector<int64_t>& sizes) {
  std::unique_ptr<MemoryMap> map(new MemoryMap());
  map->pinned_ = std::make_unique<std::atomic<bool>[]>(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    // new uint8_t[n]() is zeroed and aligned for any scalar (16 bytes).
    map->owned_.push_back(std::unique_ptr<uint8_t[]>(
        new uint8_t[static_cast<size_t>(std::max<int64_t>(sizes[i], 1))]()));
    map->ids_.push_back(static_cast<uint32_t>(i));
    map->sizes_.push_back(sizes[i]);
    map->bases_.push_back(map->owned_.back().get());
    map->gpus_.push_back(kHostMemory);
  }
  return map;
}

std::unique_ptr<MemoryMap> MemoryMap::HostElsewhere(
    const std::vector<int64_t>& sizes) {
  std::unique_ptr<MemoryMap> map(new MemoryMap());
  map->pinned_ = std::make_unique<std::atomic<bool>[]>(sizes.size());
  map->mapped_ = false;
  for (size_t i = 0; i < sizes.size(); ++i) {
    map->ids_.push_back(static_cast<uint32_t>(i));
    map->sizes_.push_back(sizes[i]);
    map->bases_.push_back(nullptr);
    map->gpus_.push_back(kHostMemory);
  }
  return map;
}

absl::StatusOr<std::unique_ptr<MemoryMap>> MemoryMap::Map(
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions,
    absl::string_view who, const MapOptions& options) {
  // 1: validate everything before mapping anything.
  std::vector<const v1::MemoryRegion*> sorted;
  for (const v1::MemoryRegion& r : regions) sorted.push_back(&r);
  std::sort(sorted.begin(), sorted.end(),
            [](const v1::MemoryRegion* a, const v1::MemoryRegion* b) {
              return a->region_id() < b->region_id();
            });
  for (const v1::MemoryRegion* r : sorted) {
    if (absl::Status s = CheckRegion(*r, who, options); !s.ok()) return s;
  }

  // 2: the regions by id, not yet mapped.
  std::unique_ptr<MemoryMap> map(new MemoryMap());
  map->pinned_ = std::make_unique<std::atomic<bool>[]>(sorted.size());
  for (const v1::MemoryRegion* r : sorted) {
    const bool device = r->memory_case() == v1::MemoryRegion::kCudaIpc;
    map->ids_.push_back(r->region_id());
    map->sizes_.push_back(r->size_bytes());
    map->bases_.push_back(nullptr);
    map->gpus_.push_back(device ? -1 : kHostMemory);
  }
  if (!options.map_memory) {
    map->mapped_ = false;
    return map;
  }
  // 3: each region mapped, GPU or host.
  for (size_t i = 0; i < sorted.size(); ++i) {
    const v1::MemoryRegion& r = *sorted[i];
    if (r.memory_case() == v1::MemoryRegion::kCudaIpc) {
      absl::StatusOr<std::unique_ptr<DeviceRegion>> mapped =
          MapDeviceRegion(r, who, options);
      if (!mapped.ok()) return mapped.status();
      map->bases_[i] = (*mapped)->data();
      map->gpus_[i] = (*mapped)->gpu();
      map->device_regions_.push_back(*std::move(mapped));
      continue;
    }
    absl::StatusOr<SharedMemoryRegion> opened = MapSharedMemory(r, who, options);
    if (!opened.ok()) return opened.status();
    map->bases_[i] = opened->data() + r.shared_memory().file_offset_bytes();
    map->regions_.push_back(*std::move(opened));
  }
  // 4: the host regions in the address index, for DescribeAddress.
  {
    AddressIndex& index = Index();
    absl::MutexLock lock(&index.mu);
    for (size_t i = 0; i < map->ids_.size(); ++i) {
      if (map->on_device(i)) continue;
      const uintptr_t base = reinterpret_cast<uintptr_t>(map->bases_[i]);
      index.ranges[base] = MappedRange{
          base + static_cast<uintptr_t>(map->sizes_[i]), std::string(who),
          map->ids_[i]};
    }
    map->indexed_ = true;
  }
  return map;
}

int32_t MemoryMap::IndexOf(uint32_t region_id) const {
  auto it = std::lower_bound(ids_.begin(), ids_.end(), region_id);
  if (it == ids_.end() || *it != region_id) return -1;
  return static_cast<int32_t>(it - ids_.begin());
}

absl::Status MemoryMap::PinForGpus(size_t index, DeviceMemory* devices) const {
  absl::MutexLock lock(&pin_mu_);
  if (pins_.size() < ids_.size()) pins_.resize(ids_.size());
  if (pins_[index] != nullptr) return absl::OkStatus();
  if (on_device(index) || bases_[index] == nullptr || devices == nullptr) {
    return absl::InternalError("only mapped host regions can be pinned");
  }
  absl::StatusOr<std::unique_ptr<PinnedHost>> pin =
      devices->PinHost(bases_[index], sizes_[index], /*read_only=*/false);
  if (!pin.ok()) return pin.status();
  pins_[index] = *std::move(pin);
  pinned_[index].store(true, std::memory_order_release);
  return absl::OkStatus();
}

bool MemoryMap::pinned(size_t index) const {
  return index < ids_.size() && pinned_[index].load(std::memory_order_acquire);
}

int MemoryMap::first_gpu() const {
  for (size_t i = 0; i < size(); ++i) {
    if (on_device(i)) return gpu(i);
  }
  return -1;
}

bool MemoryMap::any_on_device() const {
  for (size_t i = 0; i < gpus_.size(); ++i) {
    if (on_device(i)) return true;
  }
  return false;
}

int64_t MemoryMap::total_bytes() const {
  int64_t total = 0;
  for (int64_t s : sizes_) total += s;
  return total;
}

absl::Status MemoryMap::CheckRange(uint32_t region_id, int64_t offset,
                                   int64_t length, absl::string_view who,
                                   absl::string_view what) const {
  const int32_t index = IndexOf(region_id);
  if (index < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", what, " is in region ", region_id,
                     ", which the rank did not register"));
  }
  int64_t end;
  if (offset < 0 || length < 0 || !CheckedAdd(offset, length, &end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", what, " has a negative or overflowing byte range"));
  }
  if (end > sizes_[index]) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", what, " ends at byte ", end, ", past the end of region ",
        region_id, " (", sizes_[index], " bytes)"));
  }
  return absl::OkStatus();
}

}  // namespace ferry
