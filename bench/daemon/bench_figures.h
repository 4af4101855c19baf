// What the daemon benchmarks measure against and report with: the median of
// repeated timings, and single-thread memcpy bandwidth (the physical limit
// each same-node figure is a ratio of).
#ifndef FERRY_BENCH_DAEMON_BENCH_FIGURES_H_
#define FERRY_BENCH_DAEMON_BENCH_FIGURES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ferry {
namespace bench {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Best of 3 single-thread memcpy passes of `bytes` from src to dst, bytes/s.
inline double MemcpyBandwidth(const uint8_t* src, uint8_t* dst, int64_t bytes) {
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const absl::Time start = absl::Now();
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    best = std::max(best, bytes / absl::ToDoubleSeconds(absl::Now() - start));
  }
  return best;
}

}  // namespace bench
}  // namespace ferry

#endif  // FERRY_BENCH_DAEMON_BENCH_FIGURES_H_
