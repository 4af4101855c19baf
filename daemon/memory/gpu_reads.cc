#include "daemon/memory/gpu_reads.h"

#include <sys/mman.h>

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "transport/memory_fault_guard.h"

namespace ferry {
namespace {

bool OnGpu(const HeldPiece& h, const std::vector<const MemoryMap*>& maps) {
  const size_t r = static_cast<size_t>(h.rank);
  const MemoryMap* m = r < maps.size() ? maps[r] : nullptr;
  return m != nullptr && h.piece->buffer < m->size() &&
         m->on_device(h.piece->buffer);
}

}  // namespace

GpuReads::GpuReads(DeviceMemory* devices, int64_t slot_bytes, int slots)
    : devices_(devices),
      slot_bytes_(std::max<int64_t>(slot_bytes, 1)),
      count_(std::max(slots, 1)) {}

GpuReads::~GpuReads() {
  absl::MutexLock lock(&mu_);
  for (Slot& s : slots_) {
    s.pin.reset();  // unpinned before unmapped
    if (s.data != nullptr) ::munmap(s.data, static_cast<size_t>(slot_bytes_));
  }
}

GpuReads::Host::~Host() {
  if (owner_ != nullptr) owner_->Release(slot_);
}

int64_t GpuReads::GpuBytes(const std::vector<HeldPiece>& held,
                           const std::vector<const MemoryMap*>& maps,
                           DType dtype) {
  int64_t bytes = 0;
  for (const HeldPiece& h : held) {
    if (OnGpu(h, maps)) bytes += BoxBytes(h.piece->box, dtype);
  }
  return bytes;
}

absl::StatusOr<int> GpuReads::Acquire() {
  absl::MutexLock lock(&mu_);
  if (slots_.empty()) {
    // Allocated and pinned once, at the first read (not with the plan:
    // most plans never read GPU memory).
    for (int i = 0; i < count_; ++i) {
      Slot s;
      void* p = ::mmap(nullptr, static_cast<size_t>(slot_bytes_),
                       PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
      if (p == MAP_FAILED) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "reading GPU memory: ", slot_bytes_, " bytes of host scratch"));
      }
      s.data = static_cast<uint8_t*>(p);
      absl::StatusOr<std::unique_ptr<PinnedHost>> pin =
          devices_->PinHost(s.data, slot_bytes_, /*read_only=*/false);
      if (!pin.ok()) {
        ::munmap(s.data, static_cast<size_t>(slot_bytes_));
        return pin.status();
      }
      s.pin = *std::move(pin);
      slots_.push_back(std::move(s));
      busy_.push_back(false);
    }
  }
  auto free_slot = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (bool b : busy_) {
      if (!b) return true;
    }
    return false;
  };
  mu_.Await(absl::Condition(&free_slot));
  for (size_t i = 0; i < busy_.size(); ++i) {
    if (!busy_[i]) {
      busy_[i] = true;
      return static_cast<int>(i);
    }
  }
  return absl::InternalError("no free slot");  // cannot happen
}

void GpuReads::Release(int slot) {
  absl::MutexLock lock(&mu_);
  busy_[static_cast<size_t>(slot)] = false;
}

absl::StatusOr<std::unique_ptr<GpuReads::Host>> GpuReads::Read(
    const std::vector<HeldPiece>& held,
    const std::vector<std::vector<const uint8_t*>>& bases,
    const std::vector<const MemoryMap*>& maps, DType dtype) {
  const int64_t bytes = GpuBytes(held, maps, dtype);
  if (bytes > slot_bytes_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "reading GPU memory: ", bytes, " bytes of a tensor's pieces, past ",
        slot_bytes_, " bytes of host scratch"));
  }
  if (bytes > 0 && devices_ == nullptr) {
    return absl::FailedPreconditionError(
        "a trainer rank's memory is on a GPU, and this ferryd has none");
  }
  auto host = std::unique_ptr<Host>(new Host());
  host->bases_ = bases;
  host->copies_.reserve(held.size());  // `held_` points into it
  if (bytes == 0) {
    host->held_ = held;
    return host;
  }
  absl::StatusOr<int> slot = Acquire();
  if (!slot.ok()) return slot.status();
  host->owner_ = this;
  host->slot_ = *slot;
  uint8_t* scratch;
  {
    absl::MutexLock lock(&mu_);
    scratch = slots_[static_cast<size_t>(*slot)].data;
  }
  std::map<int, std::vector<LocalCopy>> by_gpu;
  int64_t at = 0;
  for (const HeldPiece& h : held) {
    if (!OnGpu(h, maps)) {
      host->held_.push_back(h);
      continue;
    }
    const MemoryMap& m = *maps[static_cast<size_t>(h.rank)];
    const Piece& p = *h.piece;
    host->copies_.push_back(Piece::Contiguous(p.param, p.box, 0, 0, dtype));
    const Piece& copy = host->copies_.back();
    LocalCopy c;
    c.src.base = m.base(p.buffer) + ByteOffsetOf(p, p.box, dtype);
    c.src.strides = p.strides;
    c.dst.base = scratch + at;
    c.dst.strides = copy.strides;
    c.extent = StorageBox(p.box, dtype).extent;
    c.unit_bytes = UnitBytes(dtype);
    by_gpu[m.gpu(p.buffer)].push_back(std::move(c));
    host->bases_.push_back({scratch + at});
    host->held_.push_back(HeldPiece{
        static_cast<int32_t>(host->bases_.size() - 1), &copy});
    at += BoxBytes(p.box, dtype);
  }
  for (auto& [gpu, copies] : by_gpu) {
    CopyEngine* engine = devices_->Engine(gpu);
    if (engine == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("reading GPU memory: no copy engine for GPU ", gpu));
    }
    absl::Status s = engine->Run(copies);
    if (!s.ok()) return s;
  }
  return host;
}

absl::Status RunOnHostPieces(
    GpuReads* reads, const std::vector<HeldPiece>& held,
    const std::vector<std::vector<const uint8_t*>>& bases,
    const std::vector<const MemoryMap*>& maps, DType dtype,
    const std::function<absl::Status(
        const std::vector<HeldPiece>&,
        const std::vector<std::vector<const uint8_t*>>&)>& work) {
  std::unique_ptr<GpuReads::Host> host;
  if (reads != nullptr) {
    absl::StatusOr<std::unique_ptr<GpuReads::Host>> read =
        reads->Read(held, bases, maps, dtype);
    if (!read.ok()) return read.status();
    host = *std::move(read);
  }
  absl::Status status;
  absl::Status guarded = RunGuarded([&] {
    status = host != nullptr ? work(host->held(), host->bases())
                             : work(held, bases);
  });
  return guarded.ok() ? status : NameMemoryFault(guarded);
}

}  // namespace ferry
