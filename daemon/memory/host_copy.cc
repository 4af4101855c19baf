#include "daemon/memory/host_copy.h"

#include <sys/mman.h>

#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "transport/transport.h"

namespace ferry {
namespace {

// The widest unit that divides the region and both addresses: the copy
// engine moves whole units.
int64_t UnitFor(int64_t bytes, const uint8_t* a, const uint8_t* b) {
  for (int64_t unit : {16, 8, 4, 2}) {
    if (bytes % unit == 0 && reinterpret_cast<uintptr_t>(a) % unit == 0 &&
        reinterpret_cast<uintptr_t>(b) % unit == 0) {
      return unit;
    }
  }
  return 1;
}

// One region's bytes from `from` to `to`; `gpu` >= 0 when one side is
// device memory on that GPU (the other is pinned host memory).
absl::Status CopyBytes(uint8_t* to, const uint8_t* from, int64_t bytes,
                       int gpu, DeviceMemory* devices) {
  if (gpu < 0) {
    std::memcpy(to, from, static_cast<size_t>(bytes));
    return absl::OkStatus();
  }
  CopyEngine* engine = devices == nullptr ? nullptr : devices->Engine(gpu);
  if (engine == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("no copy engine for GPU ", gpu));
  }
  LocalCopy c;
  const int64_t unit = UnitFor(bytes, from, to);
  c.src.base = const_cast<uint8_t*>(from);
  c.src.strides = Dims{1};
  c.dst.base = to;
  c.dst.strides = Dims{1};
  c.extent = Dims{bytes / unit};
  c.unit_bytes = unit;
  return engine->Run({c});
}

}  // namespace

int64_t AvailableHostMemory() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t kib = -1;
    fields >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

HostCopy::~HostCopy() {
  for (auto& rank : ranks_) {
    for (Region& r : rank) {
      r.pin.reset();  // unpinned before unmapped
      if (r.data != nullptr) ::munmap(r.data, static_cast<size_t>(r.bytes));
    }
  }
}

absl::StatusOr<std::unique_ptr<HostCopy>> HostCopy::Take(
    const std::vector<Rank>& ranks, int64_t version, DeviceMemory* devices,
    const std::atomic<bool>* cancel) {
  std::unique_ptr<HostCopy> copy(new HostCopy());
  copy->version_ = version;
  copy->ranks_.resize(ranks.size());
  for (size_t t = 0; t < ranks.size(); ++t) {
    copy->ids_.push_back(ranks[t].id);
    const std::string& who = ranks[t].who;
    if (ranks[t].memory == nullptr || !ranks[t].memory->mapped() ||
        ranks[t].memory->released()) {
      return absl::FailedPreconditionError(
          absl::StrCat(who, ": its memory is not mapped by this ferryd"));
    }
    const MemoryMap& map = *ranks[t].memory;
    for (size_t i = 0; i < map.size(); ++i) {
      if (cancel != nullptr && cancel->load()) {
        return absl::CancelledError("the offload was aborted");
      }
      Region r;
      r.id = map.region_id(i);
      r.bytes = map.bytes(i);
      void* data = ::mmap(nullptr, static_cast<size_t>(r.bytes),
                          PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                          -1, 0);
      if (data == MAP_FAILED) {
        return absl::ResourceExhaustedError(absl::StrCat(
            who, ": no memory for the host copy of region ", r.id,
            " (", r.bytes, " bytes): ", std::strerror(errno)));
      }
      r.data = static_cast<uint8_t*>(data);
      const int gpu = map.on_device(i) ? map.gpu(i) : -1;
      if (gpu >= 0) {
        absl::StatusOr<std::unique_ptr<PinnedHost>> pin =
            devices == nullptr
                ? absl::FailedPreconditionError("no GPUs in this ferryd")
                : devices->PinHost(r.data, r.bytes, /*read_only=*/false);
        if (!pin.ok()) {
          ::munmap(r.data, static_cast<size_t>(r.bytes));
          return absl::Status(pin.status().code(),
                              absl::StrCat(who, ": region ", r.id,
                                           ": ", pin.status().message()));
        }
        r.pin = *std::move(pin);
      }
      copy->ranks_[t].push_back(std::move(r));
      Region& kept = copy->ranks_[t].back();
      absl::Status s = CopyBytes(kept.data, map.base(i), kept.bytes, gpu,
                                 devices);
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat(who, ": region ", kept.id,
                                                   ": ", s.message()));
      }
      copy->bytes_ += kept.bytes;
    }
  }
  return copy;
}

absl::Status HostCopy::Restore(const std::vector<Rank>& ranks,
                               DeviceMemory* devices,
                               const std::atomic<bool>* cancel) const {
  // Each copied rank's memory now, checked before any byte moves.
  std::vector<const Rank*> to(ids_.size(), nullptr);
  for (size_t t = 0; t < ids_.size(); ++t) {
    for (const Rank& r : ranks) {
      if (r.id == ids_[t]) to[t] = &r;
    }
    if (to[t] == nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "participant ", ids_[t], " of the host copy is not registered"));
    }
    const MemoryMap* map = to[t]->memory.get();
    if (map == nullptr || !map->mapped() || map->released()) {
      return absl::FailedPreconditionError(absl::StrCat(
          to[t]->who, ": its memory was not registered again "
          "(Registry.UpdateRegions)"));
    }
    for (const Region& r : ranks_[t]) {
      const int32_t i = map->IndexOf(r.id);
      if (i < 0 || map->bytes(i) != r.bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            to[t]->who, ": region ", r.id, " of ", r.bytes,
            " bytes in the host copy is not registered with that size"));
      }
      if (map->on_device(i) && r.pin == nullptr) {
        // The kind of a region never changes (UpdateRegions refuses it).
        return absl::InternalError(
            absl::StrCat(to[t]->who, ": region ", r.id, " moved to a GPU"));
      }
    }
  }
  for (size_t t = 0; t < ids_.size(); ++t) {
    const MemoryMap& map = *to[t]->memory;
    for (const Region& r : ranks_[t]) {
      if (cancel != nullptr && cancel->load()) {
        return absl::CancelledError("the onload was aborted");
      }
      const int32_t i = map.IndexOf(r.id);
      absl::Status s = CopyBytes(map.base(i), r.data, r.bytes,
                                 map.on_device(i) ? map.gpu(i) : -1, devices);
      if (!s.ok()) {
        return absl::Status(s.code(), absl::StrCat(to[t]->who, ": region ",
                                                   r.id, ": ", s.message()));
      }
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
