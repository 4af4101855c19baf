// ParallelFor: every index once, on more than one thread when asked, and
// in order on the caller's thread when not.
#include "core/parallel_for.h"

#include <atomic>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"

namespace ferry {
namespace {

TEST_CASE("ParallelFor calls every index once") {
  for (size_t n : {0, 1, 2, 7, 1000}) {
    for (int threads : {0, 1, 2, 4, 64}) {
      INFO("n " << n << ", threads " << threads);
      std::vector<std::atomic<int>> calls(n);
      ParallelFor(n, threads, [&](size_t i) { calls[i].fetch_add(1); });
      for (size_t i = 0; i < n; ++i) CHECK(calls[i].load() == 1);
    }
  }
}

TEST_CASE("ParallelFor runs on the caller alone, in order, with one thread") {
  std::vector<size_t> order;
  const std::thread::id caller = std::this_thread::get_id();
  bool elsewhere = false;
  ParallelFor(5, 1, [&](size_t i) {
    order.push_back(i);
    elsewhere |= std::this_thread::get_id() != caller;
  });
  CHECK(order == std::vector<size_t>{0, 1, 2, 3, 4});
  CHECK_FALSE(elsewhere);
}

TEST_CASE("ParallelFor uses several threads when asked") {
  // Each call waits until two threads are inside at once: with one thread
  // this would wait forever, so the test bounds the wait and checks.
  std::mutex mu;
  std::set<std::thread::id> seen;
  std::atomic<int> inside{0};
  std::atomic<bool> met{false};
  ParallelFor(2, 2, [&](size_t) {
    {
      std::lock_guard<std::mutex> lock(mu);
      seen.insert(std::this_thread::get_id());
    }
    inside.fetch_add(1);
    for (int spin = 0; spin < 2000000 && inside.load() < 2; ++spin) {
      std::this_thread::yield();
    }
    if (inside.load() >= 2) met = true;
  });
  CHECK(seen.size() == 2);
  CHECK(met.load());
}

TEST_CASE("ParallelStableSort gives std::stable_sort's order on any threads") {
  // Keys with many ties: a stable sort keeps tied elements in input order,
  // which the second field records.
  std::mt19937 rng(7);
  for (size_t n : {0, 1, 5000, 20000, 100003}) {
    std::vector<std::pair<int, size_t>> input(n);
    for (size_t i = 0; i < n; ++i) {
      input[i] = {static_cast<int>(rng() % 97), i};
    }
    auto by_key = [](const std::pair<int, size_t>& a,
                     const std::pair<int, size_t>& b) {
      return a.first < b.first;
    };
    std::vector<std::pair<int, size_t>> expected = input;
    std::stable_sort(expected.begin(), expected.end(), by_key);
    for (int threads : {1, 2, 3, 5, 8}) {
      INFO("n " << n << ", threads " << threads);
      std::vector<std::pair<int, size_t>> got = input;
      ParallelStableSort(got.begin(), got.end(), threads, by_key);
      CHECK(got == expected);
    }
  }
}

TEST_CASE("PlanningThreads is between 1 and 8 by default") {
  CHECK(PlanningThreads() >= 1);
  CHECK(PlanningThreads() <= 8);
}

TEST_CASE("SetPlanningThreads overrides the default until reset with 0") {
  const int by_default = PlanningThreads();
  SetPlanningThreads(1);
  CHECK(PlanningThreads() == 1);
  SetPlanningThreads(12);
  CHECK(PlanningThreads() == 12);
  SetPlanningThreads(1000);
  CHECK(PlanningThreads() == 64);
  SetPlanningThreads(-3);  // taken as 0: the default
  CHECK(PlanningThreads() == by_default);
  SetPlanningThreads(5);
  SetPlanningThreads(0);
  CHECK(PlanningThreads() == by_default);
}

}  // namespace
}  // namespace ferry
