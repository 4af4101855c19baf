// The clocks the planning benchmarks read, in milliseconds. Planning runs
// its per-rank steps on several threads, so a figure is wall time with the
// CPU time of all the process's threads beside it; single-threaded steps
// (parsing, registering) are the CPU time of the thread that does them.
#ifndef FERRY_BENCH_CLOCKS_H_
#define FERRY_BENCH_CLOCKS_H_

#include <time.h>

namespace ferry {
namespace bench {

inline double ClockMs(clockid_t clock) {
  struct timespec ts;
  clock_gettime(clock, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

inline double WallMs() { return ClockMs(CLOCK_MONOTONIC); }
inline double ThreadCpuMs() { return ClockMs(CLOCK_THREAD_CPUTIME_ID); }
inline double ProcessCpuMs() { return ClockMs(CLOCK_PROCESS_CPUTIME_ID); }

}  // namespace bench
}  // namespace ferry

#endif  // FERRY_BENCH_CLOCKS_H_
