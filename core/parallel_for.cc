#include "core/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <thread>
#include <vector>

namespace ferry {

namespace {
// 0: the default. Relaxed: a setting, not a synchronisation point.
std::atomic<int> planning_threads_override{0};
}  // namespace

void SetPlanningThreads(int n) {
  planning_threads_override.store(std::clamp(n, 0, 64),
                                  std::memory_order_relaxed);
}

int PlanningThreads() {
  const int n = planning_threads_override.load(std::memory_order_relaxed);
  if (n > 0) return n;
  const unsigned hw = std::thread::hardware_concurrency();
  return static_cast<int>(std::clamp(hw, 1u, 8u));
}

void ParallelFor(size_t n, int threads,
                 const std::function<void(size_t)>& fn) {
  const size_t workers =
      std::min(n, static_cast<size_t>(std::max(threads, 1)));
  if (workers <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Indices are taken one at a time: per-rank work is uneven (a rank
  // holding the embedding, a rank of only padding).
  std::atomic<size_t> next{0};
  auto run = [&] {
    for (size_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  };
  std::vector<std::thread> helpers;
  helpers.reserve(workers - 1);
  for (size_t t = 1; t < workers; ++t) helpers.emplace_back(run);
  run();
  for (std::thread& t : helpers) t.join();
}

}  // namespace ferry
