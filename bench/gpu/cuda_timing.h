// What the GPU benchmarks share: CHECK_CUDA (a failed call prints itself
// and exits: a benchmark has nothing to recover) and TimeMs, the median
// and range of a GPU operation's runs, timed with CUDA events.
#ifndef FERRY_BENCH_GPU_CUDA_TIMING_H_
#define FERRY_BENCH_GPU_CUDA_TIMING_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CHECK_CUDA(call)                                               \
  do {                                                                 \
    const cudaError_t e_ = (call);                                     \
    if (e_ != cudaSuccess) {                                           \
      std::fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                    \
    }                                                                  \
  } while (0)

namespace ferry {
namespace bench {

struct Timing {
  double median = 0, low = 0, high = 0;  // milliseconds
};

// `iters` runs of `fn` (after 2 warm-ups), each timed with events recorded
// on `stream` around it (calls that synchronize themselves, as a
// CopyEngine's do, are timed whole).
inline Timing TimeMs(const std::function<void()>& fn, cudaStream_t stream,
                     int iters = 10) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) fn();
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a, stream));
    fn();
    CHECK_CUDA(cudaEventRecord(b, stream));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return Timing{ms[ms.size() / 2], ms.front(), ms.back()};
}

}  // namespace bench
}  // namespace ferry

#endif  // FERRY_BENCH_GPU_CUDA_TIMING_H_
