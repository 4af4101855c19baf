#include "daemon/memory_map.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/geometry.h"

namespace ferry {
namespace {

constexpr int64_t kPageBytes = 4096;

absl::Status RegionError(absl::string_view who, uint32_t id,
                         absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat(who, ": region ", id, ": ", what));
}

}  // namespace

absl::StatusOr<std::unique_ptr<MemoryMap>> MemoryMap::Map(
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions,
    absl::string_view who) {
  // Validate everything before mapping anything.
  std::vector<const v1::MemoryRegion*> sorted;
  for (const v1::MemoryRegion& r : regions) sorted.push_back(&r);
  std::sort(sorted.begin(), sorted.end(),
            [](const v1::MemoryRegion* a, const v1::MemoryRegion* b) {
              return a->region_id() < b->region_id();
            });
  for (size_t i = 0; i < sorted.size(); ++i) {
    const v1::MemoryRegion& r = *sorted[i];
    if (i > 0 && sorted[i - 1]->region_id() == r.region_id()) {
      return RegionError(who, r.region_id(), "registered twice");
    }
    if (r.region_id() & kStagingBufferBit) {
      return RegionError(who, r.region_id(),
                         "ids with the top bit set (>= 2^31) are daemon "
                         "staging; choose an id below 2^31");
    }
    if (r.size_bytes() <= 0) {
      return RegionError(who, r.region_id(),
                         absl::StrCat("size_bytes ", r.size_bytes(),
                                      " is not positive"));
    }
    switch (r.memory_case()) {
      case v1::MemoryRegion::kCudaIpc:
        return absl::UnimplementedError(absl::StrCat(
            who, ": region ", r.region_id(),
            ": CUDA IPC regions need a ferryd built with CUDA; this one is "
            "host only"));
      case v1::MemoryRegion::kSharedMemory:
        break;
      default:
        return RegionError(who, r.region_id(),
                           "memory is required (shared_memory or cuda_ipc)");
    }
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
    } else {
      return RegionError(who, r.region_id(),
                         "shared_memory needs shm_name or memfd");
    }
  }

  std::unique_ptr<MemoryMap> map(new MemoryMap());
  for (const v1::MemoryRegion* r : sorted) {
    const v1::SharedMemoryRegion& shm = r->shared_memory();
    const int64_t offset = shm.file_offset_bytes();
    const int64_t length = offset + r->size_bytes();
    absl::StatusOr<SharedMemoryRegion> opened =
        shm.memory_case() == v1::SharedMemoryRegion::kShmName
            ? SharedMemoryRegion::Open(shm.shm_name(), length)
            : SharedMemoryRegion::OpenByPath(
                  absl::StrCat("/proc/", shm.memfd().pid(), "/fd/",
                               shm.memfd().fd()),
                  length);
    if (!opened.ok()) {
      return RegionError(who, r->region_id(),
                         absl::StrCat("cannot be mapped: ",
                                      opened.status().message()));
    }
    map->ids_.push_back(r->region_id());
    map->bases_.push_back(opened->data() + offset);
    map->sizes_.push_back(r->size_bytes());
    map->regions_.push_back(*std::move(opened));
  }
  return map;
}

int32_t MemoryMap::IndexOf(uint32_t region_id) const {
  auto it = std::lower_bound(ids_.begin(), ids_.end(), region_id);
  if (it == ids_.end() || *it != region_id) return -1;
  return static_cast<int32_t>(it - ids_.begin());
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

absl::Status ValidatePiecesInRegions(const MemoryMap& map,
                                     const std::vector<ParamSpec>& params,
                                     const std::vector<Piece>& pieces,
                                     absl::string_view who) {
  for (const Piece& p : pieces) {
    const ParamSpec& spec = params[p.param];
    const std::string what = absl::StrCat("piece of ", spec.name, " box ",
                                          BoxToString(p.box));
    if (p.byte_offset < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": ", what, " has negative byte_offset ", p.byte_offset));
    }
    absl::StatusOr<int64_t> end = PieceEndByte(p, spec.dtype);
    if (!end.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": ", what, ": ", end.status().message()));
    }
    absl::Status s = map.CheckRange(p.buffer, 0, *end, who, what);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace ferry
