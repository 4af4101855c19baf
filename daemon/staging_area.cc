#include "daemon/staging_area.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/piece.h"

namespace ferry {

StagingArea::StagingArea(std::string name_hint, DeviceMemory* pin_for_gpus)
    : name_hint_(std::move(name_hint)), pin_for_gpus_(pin_for_gpus) {}

absl::Status StagingArea::Reserve(
    const std::vector<std::pair<std::string, int64_t>>& needs) {
  std::map<std::string, Slot> kept;
  for (const auto& [param, bytes] : needs) {
    auto it = slots_.find(param);
    if (it != slots_.end() && it->second.bytes == bytes) {
      kept.emplace(param, std::move(it->second));
      slots_.erase(it);
      continue;
    }
    // A zero-byte tensor still gets a (one-byte) region: it keeps ids simple.
    absl::StatusOr<SharedMemoryRegion> memory = SharedMemoryRegion::Create(
        absl::StrCat("staging-", name_hint_), std::max<int64_t>(bytes, 1));
    if (!memory.ok()) {
      for (auto& [p, slot] : kept) slots_.emplace(p, std::move(slot));
      return absl::ResourceExhaustedError(
          absl::StrCat("staging for ", param, " (", bytes,
                       " bytes) cannot be reserved: ",
                       memory.status().message()));
    }
    std::unique_ptr<PinnedHost> pinned;
    if (pin_for_gpus_ != nullptr) {
      absl::StatusOr<std::unique_ptr<PinnedHost>> p =
          pin_for_gpus_->PinHost(memory->data(), memory->size(),
                                 /*read_only=*/false);
      if (!p.ok()) {
        for (auto& [name, slot] : kept) slots_.emplace(name, std::move(slot));
        return absl::ResourceExhaustedError(
            absl::StrCat("staging for ", param, " (", bytes,
                         " bytes) cannot be pinned for the GPUs: ",
                         p.status().message()));
      }
      pinned = *std::move(p);
    }
    Slot slot{kStagingBufferBit | next_id_++, bytes, *std::move(memory),
              std::move(pinned)};
    kept.emplace(param, std::move(slot));
  }
  slots_ = std::move(kept);  // the rest are released here
  return absl::OkStatus();
}

const StagingArea::Slot* StagingArea::Find(const std::string& parameter) const {
  auto it = slots_.find(parameter);
  return it == slots_.end() ? nullptr : &it->second;
}

std::vector<v1::MemoryRegion> StagingArea::Exported() const {
  std::vector<v1::MemoryRegion> out;
  for (const auto& [param, slot] : slots_) {
    v1::MemoryRegion r;
    r.set_region_id(slot.region_id);
    r.set_size_bytes(slot.memory.size());
    r.mutable_shared_memory()->set_shm_name(slot.memory.name());
    out.push_back(std::move(r));
  }
  std::sort(out.begin(), out.end(),
            [](const v1::MemoryRegion& a, const v1::MemoryRegion& b) {
              return a.region_id() < b.region_id();
            });
  return out;
}

}  // namespace ferry
