#include "daemon/transfer/delta_shadows.h"

#include <algorithm>
#include <atomic>
#include <cstring>

#include "core/parallel_for.h"
#include "transport/memory_fault_guard.h"

namespace ferry {

void DiffIntoShadow(const uint8_t* now, uint8_t* shadow, int64_t n,
                    uint64_t* bits) {
  // Four chunks a word: the high bit of each 16-bit lane of
  // ((x & 0x7fff..) + 0x7fff..) | x is set iff the lane of x is nonzero.
  constexpr uint64_t kLow = 0x7FFF7FFF7FFF7FFFull;
  constexpr uint64_t kHigh = 0x8000800080008000ull;
  const int64_t words = n / 8;
  std::fill(bits, bits + (n / 2 + 63) / 64, 0);
  for (int64_t w = 0; w < words; ++w) {
    uint64_t a, b;
    std::memcpy(&a, now + 8 * w, 8);
    std::memcpy(&b, shadow + 8 * w, 8);
    const uint64_t x = a ^ b;
    if (x == 0) continue;
    std::memcpy(shadow + 8 * w, &a, 8);
    const uint64_t t = (((x & kLow) + kLow) | x) & kHigh;
    const uint64_t four = ((t >> 15) & 1) | ((t >> 30) & 2) |
                          ((t >> 45) & 4) | ((t >> 60) & 8);
    const int64_t chunk = 4 * w;
    bits[chunk >> 6] |= four << (chunk & 63);
  }
  for (int64_t c = 4 * words; c < n / 2; ++c) {  // the tail
    if (std::memcmp(now + 2 * c, shadow + 2 * c, 2) != 0) {
      std::memcpy(shadow + 2 * c, now + 2 * c, 2);
      bits[c >> 6] |= uint64_t{1} << (c & 63);
    }
  }
}

DeltaShadows::DeltaShadows(int64_t budget_bytes)
    : budget_bytes_(std::max<int64_t>(budget_bytes, 0)) {}

int64_t DeltaShadows::used_bytes() const {
  absl::MutexLock lock(&mu_);
  return used_bytes_;
}

std::shared_ptr<DeltaShadows::Shadow> DeltaShadows::ShadowOf(const Key& key,
                                                             int64_t bytes) {
  const int64_t cost = bytes + bytes / 16 + 8;
  absl::MutexLock lock(&mu_);
  auto it = shadows_.find(key);
  if (it != shadows_.end()) {
    it->second.last_use = ++clock_;
    return it->second.shadow;
  }
  if (cost > budget_bytes_) return nullptr;
  while (used_bytes_ + cost > budget_bytes_ && !shadows_.empty()) {
    // The least recently used goes (a reader keeps its bits alive).
    auto oldest = shadows_.begin();
    for (auto e = shadows_.begin(); e != shadows_.end(); ++e) {
      if (e->second.last_use < oldest->second.last_use) oldest = e;
    }
    used_bytes_ -= oldest->second.cost;
    shadows_.erase(oldest);
  }
  Entry& entry = shadows_[key];
  entry.shadow = std::make_shared<Shadow>();
  entry.cost = cost;
  entry.last_use = ++clock_;
  used_bytes_ += cost;
  return entry.shadow;
}

DeltaShadows::Changes DeltaShadows::For(const MemoryMap* map, size_t index,
                                        int64_t version) {
  Changes none;
  if (!enabled() || map == nullptr || index >= map->size() ||
      map->on_device(index) || map->base(index) == nullptr ||
      map->bytes(index) % 2 != 0) {
    return none;
  }
  const uint8_t* base = map->base(index);
  const int64_t n = map->bytes(index);
  std::shared_ptr<Shadow> shadow = ShadowOf({map->serial(), index}, n);
  if (shadow == nullptr) return none;
  absl::MutexLock lock(&shadow->mu);
  if (shadow->version == version && shadow->base == base) {
    Changes c;
    c.since = shadow->since;
    c.bits = shadow->bits;
    c.buffer_base = base;
    return c;
  }
  // Allocated first: a fault abandons the guarded copy half way.
  const bool fresh = shadow->version == 0 || version <= shadow->version ||
                     shadow->base != base;
  std::shared_ptr<std::vector<uint64_t>> bits;
  if (fresh) {
    shadow->bytes.resize(n);
  } else {
    bits = std::make_shared<std::vector<uint64_t>>((n / 2 + 63) / 64);
  }
  // In slices on the planning threads (a trainer node's buffers are GBs:
  // one core reads about 7 GB/s of buffer and shadow); a slice is a whole
  // number of bit words (128 bytes). A client that shrank its memory
  // faults here as in any copy.
  constexpr int64_t kSlice = int64_t{16} << 20;
  std::atomic<bool> faulted{false};
  ParallelFor(static_cast<size_t>((n + kSlice - 1) / kSlice),
              PlanningThreads(), [&](size_t i) {
    const int64_t at = static_cast<int64_t>(i) * kSlice;
    const int64_t len = std::min(kSlice, n - at);
    const absl::Status s = RunGuarded([&] {
      if (fresh) {
        std::memcpy(shadow->bytes.data() + at, base + at, len);
      } else {
        DiffIntoShadow(base + at, shadow->bytes.data() + at, len,
                       bits->data() + at / 128);
      }
    });
    if (!s.ok()) faulted = true;
  });
  const absl::Status copied =
      faulted ? absl::FailedPreconditionError("source memory faulted")
              : absl::OkStatus();
  shadow->since = fresh ? 0 : shadow->version;
  shadow->bits = std::move(bits);
  if (!copied.ok()) {
    shadow->version = 0;  // half updated: start over next time
    return none;
  }
  shadow->version = version;
  shadow->base = base;
  Changes c;
  c.since = shadow->since;
  c.bits = shadow->bits;
  c.buffer_base = base;
  return c;
}

}  // namespace ferry
