#include "daemon/memory/staging_area.h"

#include <atomic>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "core/piece.h"
#include "glog/logging.h"

namespace ferry {
namespace {

constexpr absl::string_view kStagingPrefix = "ferry-staging-";
constexpr absl::string_view kLockSuffix = ".lock";

// "<pid>.<8 lower-case hex digits>", or false.
bool IsOwnerKey(absl::string_view key) {
  const size_t dot = key.find('.');
  if (dot == 0 || dot == absl::string_view::npos || key.size() != dot + 9) {
    return false;
  }
  for (size_t i = 0; i < key.size(); ++i) {
    const char c = key[i];
    if (i < dot ? !absl::ascii_isdigit(c)
                : i > dot && !(absl::ascii_isdigit(c) || (c >= 'a' && c <= 'f'))) {
      return false;
    }
  }
  return true;
}

// The owner key of a file named like staging ("ferry-staging-<owner>.lock"
// or "ferry-staging-<owner>.<anything>"), or "".
std::string OwnerOf(absl::string_view file) {
  if (!absl::ConsumePrefix(&file, kStagingPrefix)) return "";
  const size_t dot = file.find('.');
  if (dot == absl::string_view::npos) return "";
  const size_t end = file.find('.', dot + 1);
  const absl::string_view key = file.substr(0, end);
  if (end == absl::string_view::npos || !IsOwnerKey(key)) return "";
  return std::string(key);
}

// The process's owner: a lock file taken under a temporary name and then
// renamed into place, so that another ferryd never sees it unlocked.
struct Owner {
  std::string prefix;  // "ferry-staging-<key>", or "" without a lock
  std::string lock_path;
  int fd = -1;

  Owner() {
    std::random_device rd;
    const std::string key =
        absl::StrCat(::getpid(), ".", absl::Hex(rd(), absl::kZeroPad8));
    const std::string name = absl::StrCat(kStagingPrefix, key);
    lock_path = absl::StrCat("/dev/shm/", name, kLockSuffix);
    const std::string tmp = absl::StrCat("/dev/shm/.", name, ".tmp");
    fd = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
      LOG(WARNING) << "staging: cannot create " << tmp << ": "
                   << std::strerror(errno)
                   << "; staging left by a killed ferryd is not removed";
      return;
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0 ||
        ::rename(tmp.c_str(), lock_path.c_str()) != 0) {
      LOG(WARNING) << "staging: cannot lock " << lock_path << ": "
                   << std::strerror(errno);
      ::unlink(tmp.c_str());
      ::close(fd);
      fd = -1;
      return;
    }
    prefix = name;
  }
  // A normal exit removes the lock file; a killed process leaves it for
  // the next RemoveStaleStaging.
  ~Owner() {
    if (fd >= 0) ::unlink(lock_path.c_str());
  }
};

}  // namespace

const std::string& StagingArea::OwnerPrefix() {
  static const Owner owner;  // the lock lives as long as the process
  return owner.prefix;
}

int RemoveStaleStaging(const std::string& dir,
                       std::vector<std::string>* removed) {
  // Our own lock first: a segment of ours is never stale.
  const std::string own = OwnerOf(absl::StrCat(StagingArea::OwnerPrefix(), "."));
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return 0;
  std::map<std::string, std::vector<std::string>> by_owner;
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    const std::string owner = OwnerOf(name);
    if (!owner.empty() && owner != own) by_owner[owner].push_back(name);
  }
  ::closedir(d);
  int count = 0;
  for (const auto& [owner, files] : by_owner) {
    const std::string lock =
        absl::StrCat(dir, "/", kStagingPrefix, owner, kLockSuffix);
    const int fd = ::open(lock.c_str(), O_RDWR | O_CLOEXEC);
    if (fd >= 0 && ::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      ::close(fd);  // held: that ferryd is alive
      continue;
    }
    // Free (or missing): its owner is gone. Segments first, the lock last.
    std::vector<std::string> order = files;
    std::stable_partition(order.begin(), order.end(), [](const std::string& f) {
      return !absl::EndsWith(f, kLockSuffix);
    });
    for (const std::string& f : order) {
      if (::unlink(absl::StrCat(dir, "/", f).c_str()) == 0) {
        ++count;
        if (removed != nullptr) removed->push_back(f);
      }
    }
    if (fd >= 0) ::close(fd);
  }
  if (count > 0) {
    LOG(INFO) << "removed " << count << " staging files left in " << dir
              << " by ferryd processes that are gone";
  }
  return count;
}

StagingArea::StagingArea(std::string name_hint, DeviceMemory* devices,
                         int gpu)
    : name_hint_(std::move(name_hint)), devices_(devices), gpu_(gpu) {
  if (devices_ == nullptr || gpu_ < 0) return;
  for (const GpuInfo& info : devices_->Devices()) {
    if (info.ordinal == gpu_) gpu_uuid_ = info.uuid;
  }
}

namespace {

// Staging region ids are unique in the process, not per area: a rank's
// APPLYs list its base staging and each adapter's (an area each), and the
// client keys its mappings by id. 2^31 of them before one repeats.
uint32_t NextRegionId() {
  static std::atomic<uint32_t> next{0};
  return next.fetch_add(1) & ~kStagingBufferBit;
}

}  // namespace

absl::StatusOr<StagingArea::Slot> StagingArea::NewSlot(
    const std::string& param, int64_t bytes) {
  Slot slot;
  slot.region_id = kStagingBufferBit | NextRegionId();
  slot.bytes = bytes;
  if (gpu() >= 0) {
    absl::StatusOr<std::unique_ptr<ExportedDeviceBuffer>> device =
        devices_->AllocateExported(gpu_, bytes);
    if (!device.ok()) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "device staging for ", param, " (", bytes,
          " bytes) cannot be allocated: ", device.status().message(),
          " (ferryd --nodevice_staging stages in host memory instead)"));
    }
    slot.device = *std::move(device);
    return slot;
  }
  // A zero-byte tensor still gets a (one-byte) region: it keeps ids simple.
  // "/ferry-staging-<owner>.<hint>-<pid>-<n>": recognisable by the next
  // ferryd if this one dies (RemoveStaleStaging).
  const std::string& owner = OwnerPrefix();
  absl::StatusOr<SharedMemoryRegion> memory = SharedMemoryRegion::Create(
      owner.empty() ? absl::StrCat("staging-", name_hint_)
                    : absl::StrCat(owner.substr(strlen("ferry-")), ".",
                                   name_hint_),
      std::max<int64_t>(bytes, 1));
  if (!memory.ok()) {
    return absl::ResourceExhaustedError(
        absl::StrCat("staging for ", param, " (", bytes,
                     " bytes) cannot be reserved: ",
                     memory.status().message()));
  }
  slot.host.emplace(*std::move(memory));
  if (devices_ != nullptr) {
    absl::StatusOr<std::unique_ptr<PinnedHost>> p = devices_->PinHost(
        slot.host->data(), slot.host->size(), /*read_only=*/false);
    if (!p.ok()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("staging for ", param, " (", bytes,
                       " bytes) cannot be pinned for the GPUs: ",
                       p.status().message()));
    }
    slot.pinned = *std::move(p);
  }
  return slot;
}

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
    absl::StatusOr<Slot> slot = NewSlot(param, bytes);
    if (!slot.ok()) {
      for (auto& [p, old] : kept) slots_.emplace(p, std::move(old));
      return slot.status();
    }
    kept.emplace(param, *std::move(slot));
  }
  slots_ = std::move(kept);  // the rest are released here
  return absl::OkStatus();
}

int64_t StagingArea::reserved_bytes() const {
  int64_t total = 0;
  for (const auto& [param, slot] : slots_) total += slot.bytes;
  return total;
}

int64_t StagingArea::NewBytes(
    const std::vector<std::pair<std::string, int64_t>>& needs) const {
  int64_t total = 0;
  for (const auto& [param, bytes] : needs) {
    auto it = slots_.find(param);
    if (it == slots_.end() || it->second.bytes != bytes) total += bytes;
  }
  return total;
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
    if (slot.device != nullptr) {
      r.set_size_bytes(std::max<int64_t>(slot.bytes, 1));
      v1::CudaIpcRegion* ipc = r.mutable_cuda_ipc();
      ipc->set_ipc_handle(slot.device->ipc_handle());
      ipc->set_allocation_offset_bytes(0);
      ipc->mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
      ipc->mutable_device()->set_cuda_uuid(gpu_uuid_);
    } else {
      r.set_size_bytes(slot.host->size());
      r.mutable_shared_memory()->set_shm_name(slot.host->name());
    }
    out.push_back(std::move(r));
  }
  std::sort(out.begin(), out.end(),
            [](const v1::MemoryRegion& a, const v1::MemoryRegion& b) {
              return a.region_id() < b.region_id();
            });
  return out;
}

}  // namespace ferry
