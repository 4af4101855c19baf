#include "daemon/transfer/box_hash.h"

#include <algorithm>
#include <memory>
#include <thread>

#include "core/parallel_for.h"
#include "transport/memory_fault_guard.h"
#include "xxhash.h"
#if defined(__x86_64__) || defined(__i386__)
// Debian's libxxhash also ships XXH3 built for AVX2 / AVX-512 and picks one
// at run time; this header redirects XXH3_64bits and XXH3_64bits_update to
// it (4x the default SSE2 code's 5-6 GB/s on the dev VM).
#include "xxh_x86dispatch.h"
#endif

namespace ferry {
namespace {

// Below this many bytes a set is hashed on the calling thread.
constexpr int64_t kParallelBytes = int64_t{8} << 20;

// One side of a box with merged dims: `run_bytes` contiguous, repeated over
// the outer dims.
struct Runs {
  Dims extent;   // outer dims, units
  Dims strides;  // outer strides, units
  int64_t run_bytes = 0;
};

Runs Coalesce(const Dims& strides, const Dims& extent, int64_t unit_bytes) {
  Runs r;
  Dims e, s;
  for (size_t i = 0; i < extent.size(); ++i) {
    if (extent[i] == 1) continue;  // no iterations; would block merging
    e.push_back(extent[i]);
    s.push_back(strides[i]);
  }
  int64_t run_units = 1;
  while (!e.empty() && s.back() == run_units) {
    run_units *= e.back();
    e.pop_back();
    s.pop_back();
  }
  r.run_bytes = run_units * unit_bytes;
  for (size_t i = 0; i < e.size(); ++i) {
    if (!r.extent.empty() && r.strides.back() == s[i] * e[i]) {
      r.extent.back() *= e[i];
      r.strides.back() = s[i];
    } else {
      r.extent.push_back(e[i]);
      r.strides.push_back(s[i]);
    }
  }
  return r;
}

struct StateDeleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

uint64_t HashBytes(const uint8_t* data, int64_t bytes) {
  return XXH3_64bits(data, static_cast<size_t>(bytes));
}

uint64_t HashBox(const uint8_t* base, const Dims& strides, const Dims& extent,
                 int64_t unit_bytes) {
  for (int64_t e : extent) {
    if (e == 0) return XXH3_64bits(nullptr, 0);
  }
  const Runs r = Coalesce(strides, extent, unit_bytes);
  const size_t n = r.extent.size();
  if (n == 0) return HashBytes(base, r.run_bytes);
  // Streaming XXH3 over the runs gives the one-shot hash of their
  // concatenation, so layouts that differ only in strides agree.
  std::unique_ptr<XXH3_state_t, StateDeleter> state(XXH3_createState());
  XXH3_64bits_reset(state.get());
  Dims index(n, 0);
  const uint8_t* p = base;
  while (true) {
    XXH3_64bits_update(state.get(), p, static_cast<size_t>(r.run_bytes));
    size_t k = n;
    while (true) {
      if (k == 0) return XXH3_64bits_digest(state.get());
      --k;
      if (++index[k] < r.extent[k]) {
        p += r.strides[k] * unit_bytes;
        break;
      }
      p -= (r.extent[k] - 1) * r.strides[k] * unit_bytes;
      index[k] = 0;
    }
  }
}

int DefaultHashThreads() {
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(4, cores));
}

void HashLocal(const std::vector<LocalBox>& boxes, int threads,
               std::vector<uint64_t>* out, std::vector<char>* faulted,
               const std::atomic<bool>* cancel) {
  out->assign(boxes.size(), 0);
  faulted->assign(boxes.size(), 0);
  int64_t bytes = 0;
  for (const LocalBox& b : boxes) bytes += b.bytes;
  // One guard (a sigsetjmp, which saves the signal mask: a syscall) per
  // run of kBoxesPerGuard boxes, not per box: a model has 10^5 small
  // copies. A fault marks the box it hit and the run resumes after it.
  constexpr int64_t kBoxesPerGuard = 256;
  const int64_t n = static_cast<int64_t>(boxes.size());
  const int64_t runs = (n + kBoxesPerGuard - 1) / kBoxesPerGuard;
  if (threads <= 0) threads = DefaultHashThreads();
  ParallelFor(static_cast<size_t>(runs), bytes < kParallelBytes ? 1 : threads,
              [&](size_t r) {
    const int64_t run = static_cast<int64_t>(r);
    const int64_t end = std::min(n, (run + 1) * kBoxesPerGuard);
    // Written before each box, read after a fault: volatile, since the
    // fault returns by siglongjmp.
    volatile int64_t at = run * kBoxesPerGuard;
    while (at < end) {
      absl::Status s = RunGuarded([&] {
        for (; at < end; at = at + 1) {
          if (cancel != nullptr && cancel->load()) {
            at = end;
            return;
          }
          const LocalBox& b = boxes[at];
          (*out)[at] = HashBox(b.base, *b.strides, b.extent, b.unit_bytes);
        }
      });
      if (!s.ok()) {
        (*faulted)[at] = 1;
        at = at + 1;
      }
    }
  });
}

}  // namespace ferry
