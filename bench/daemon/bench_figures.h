// What the daemon benchmarks measure against and report with: the median
// and percentiles of repeated timings, single-thread memcpy bandwidth (the
// physical limit each same-node figure is a ratio of) and a raw loopback TCP
// stream (the limit of each figure between daemons).
#ifndef FERRY_BENCH_DAEMON_BENCH_FIGURES_H_
#define FERRY_BENCH_DAEMON_BENCH_FIGURES_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ferry {
namespace bench {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The p-th quantile (0 to 1) of `v`, nearest rank; v not empty.
inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1,
                            static_cast<size_t>(p * (v.size() - 1) + 0.5));
  return v[i];
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

// Seconds a plain blocking loopback TCP socket (kernel defaults, sender and
// receiver on two threads) takes to move `bytes` from src to dst.
absl::StatusOr<double> RawLoopbackSeconds(const uint8_t* src, uint8_t* dst,
                                          int64_t bytes);

}  // namespace bench
}  // namespace ferry

#endif  // FERRY_BENCH_DAEMON_BENCH_FIGURES_H_
