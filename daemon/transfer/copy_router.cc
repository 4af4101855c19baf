#include "daemon/transfer/copy_router.h"

#include <string>
#include <thread>

#include "absl/strings/str_cat.h"

namespace ferry {

BufferPlace PlaceIn(const MemoryMap& memory, size_t index) {
  BufferPlace place;
  if (index >= memory.size()) return place;
  place.base = memory.base(index);
  place.gpu = memory.on_device(index) ? memory.gpu(index) : -1;
  place.pinned = !place.on_gpu() && memory.pinned(index);
  place.map = &memory;
  place.index = index;
  return place;
}

const char* KindOf(const BufferPlace& place) {
  return place.on_gpu() ? "GPU memory" : "host memory";
}

void CopyRouter::Batch::Add(CopyEngine* engine, LocalCopy copy) {
  for (auto& [e, copies] : groups_) {
    if (e == engine) {
      copies.push_back(std::move(copy));
      return;
    }
  }
  groups_.emplace_back(engine, std::vector<LocalCopy>{std::move(copy)});
}

void CopyRouter::Batch::Clear() {
  for (auto& group : groups_) group.second.clear();
}

CopyRouter::CopyRouter(CopyEngine* host_engine, DeviceMemory* devices)
    : host_engine_(host_engine), devices_(devices) {}

absl::StatusOr<CopyEngine*> CopyRouter::EngineFor(BufferPlace& src,
                                                   BufferPlace& dst) const {
  if (!src.on_gpu() && !dst.on_gpu()) {
    if (host_engine_ == nullptr) {
      return absl::UnavailableError("this node has no host copy engine");
    }
    return host_engine_;
  }
  for (BufferPlace* side : {&src, &dst}) {
    if (side->on_gpu() || side->pinned) continue;
    if (side->map == nullptr) {
      return absl::UnimplementedError(
          "its host memory is daemon staging that is not pinned for the GPUs");
    }
    absl::Status s = side->map->PinForGpus(side->index, devices_);
    if (!s.ok()) {
      return absl::UnimplementedError(absl::StrCat(
          "its host memory cannot be pinned for the GPUs: ", s.message()));
    }
    side->pinned = true;
  }
  const int gpu = dst.on_gpu() ? dst.gpu : src.gpu;
  CopyEngine* engine = devices_ == nullptr ? nullptr : devices_->Engine(gpu);
  if (engine == nullptr) {
    return absl::InternalError(absl::StrCat("no copy engine for GPU ", gpu));
  }
  return engine;
}

absl::Status CopyRouter::Run(Batch& batch) const {
  std::vector<std::pair<CopyEngine*, std::vector<LocalCopy>>*> work;
  for (auto& group : batch.groups_) {
    if (!group.second.empty()) work.push_back(&group);
  }
  std::vector<absl::Status> results(work.size());
  std::vector<std::thread> others;
  for (size_t i = 1; i < work.size(); ++i) {
    others.emplace_back([&results, &work, i] {
      results[i] = work[i]->first->Run(work[i]->second);
    });
  }
  if (!work.empty()) results[0] = work[0]->first->Run(work[0]->second);
  for (std::thread& t : others) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace ferry
