// Runs independent per-index work on several cores.
//
// Planning a large stream is a sum of per-rank work that shares nothing
// mutable: validating each destination rank's pieces, for one. ParallelFor
// hands the indices out to a few short-lived threads (and the caller), so
// that a coordinator with idle cores plans in a fraction of the time. The
// results stay deterministic: each index writes only its own slot, and the
// caller combines the slots in index order.
//
// Pure but for one process-wide setting (SetPlanningThreads); any thread.
#ifndef FERRY_CORE_PARALLEL_FOR_H_
#define FERRY_CORE_PARALLEL_FOR_H_

#include <algorithm>
#include <cstddef>
#include <functional>
#include <vector>

namespace ferry {

// The threads ParallelFor uses at most, the caller included: the machine's
// hardware threads, at most 8 (a plan's per-rank work is tens of
// milliseconds per rank; more threads would mostly wait on memory).
// SetPlanningThreads overrides it.
int PlanningThreads();

// What PlanningThreads() returns from now on: n >= 1 that many (1: plan on
// the calling thread only), 0 the default above. Process-wide because
// planning is called from deep inside the daemon's registry and the
// benches alike; ferryd's --planning_threads and the benches' flag set it
// once at start. Values above 64 are taken as 64.
void SetPlanningThreads(int n);

// Calls fn(i) once for each i in [0, n), on up to `threads` threads (the
// caller's among them), and returns when every call has returned. fn must
// be safe to call concurrently for distinct indices. With threads <= 1 or
// n <= 1 everything runs on the caller's thread, in order.
void ParallelFor(size_t n, int threads, const std::function<void(size_t)>& fn);

// Sorts [first, last) as std::stable_sort(first, last, less) does, with the
// same result on any number of threads: slices are sorted side by side,
// then merged pairwise (each merge stable). `less` must be safe to call
// concurrently.
template <typename It, typename Less>
void ParallelStableSort(It first, It last, int threads, Less less) {
  const size_t n = static_cast<size_t>(last - first);
  // Below a few thousand elements a thread costs more than it saves.
  constexpr size_t kMinSlice = 4096;
  const size_t slices = std::min(static_cast<size_t>(std::max(threads, 1)),
                                 std::max<size_t>(n / kMinSlice, 1));
  if (slices <= 1) {
    std::stable_sort(first, last, less);
    return;
  }
  std::vector<size_t> bound(slices + 1);
  for (size_t i = 0; i <= slices; ++i) bound[i] = n * i / slices;
  ParallelFor(slices, threads, [&](size_t i) {
    std::stable_sort(first + bound[i], first + bound[i + 1], less);
  });
  for (size_t width = 1; width < slices; width *= 2) {
    ParallelFor((slices + 2 * width - 1) / (2 * width), threads,
                [&](size_t k) {
                  const size_t lo = 2 * width * k;
                  const size_t mid = std::min(lo + width, slices);
                  const size_t hi = std::min(lo + 2 * width, slices);
                  if (mid < hi) {
                    std::inplace_merge(first + bound[lo], first + bound[mid],
                                       first + bound[hi], less);
                  }
                });
  }
}

}  // namespace ferry

#endif  // FERRY_CORE_PARALLEL_FOR_H_
