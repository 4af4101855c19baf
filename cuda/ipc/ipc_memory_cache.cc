#include "cuda/ipc/ipc_memory_cache.h"

#include <glog/logging.h>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace gpu {

IpcMemoryCache::IpcMemoryCache(std::unique_ptr<IpcMapper> mapper)
    : mapper_(std::move(mapper)) {}

IpcMemoryCache::~IpcMemoryCache() {
  absl::MutexLock lock(&mu_);
  for (auto& [key, mapping] : mappings_) {
    const absl::Status s = mapper_->Close(key.first, mapping.base);
    LOG_IF(WARNING, !s.ok()) << "closing IPC mapping on device " << key.first
                             << ": " << s;
  }
  mappings_.clear();
}

absl::StatusOr<uint8_t*> IpcMemoryCache::Register(int device,
                                                  absl::string_view handle) {
  if (handle.size() != kCudaIpcHandleBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a CUDA IPC handle has ", kCudaIpcHandleBytes,
                     " bytes, got ", handle.size()));
  }
  absl::MutexLock lock(&mu_);
  Key key(device, std::string(handle));
  auto it = mappings_.find(key);
  if (it != mappings_.end()) {
    ++it->second.references;
    return it->second.base;
  }
  absl::StatusOr<uint8_t*> base = mapper_->Open(device, handle);
  if (!base.ok()) return base.status();
  ++opens_;
  mappings_.emplace(std::move(key), Mapping{*base, 1});
  return *base;
}

absl::Status IpcMemoryCache::Deregister(int device, absl::string_view handle) {
  absl::MutexLock lock(&mu_);
  auto it = mappings_.find(Key(device, std::string(handle)));
  if (it == mappings_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "no IPC mapping of this handle is registered on device ", device));
  }
  if (--it->second.references > 0) return absl::OkStatus();
  uint8_t* base = it->second.base;
  mappings_.erase(it);
  return mapper_->Close(device, base);
}

size_t IpcMemoryCache::size() const {
  absl::MutexLock lock(&mu_);
  return mappings_.size();
}

int64_t IpcMemoryCache::opens() const {
  absl::MutexLock lock(&mu_);
  return opens_;
}

}  // namespace gpu
}  // namespace ferry
