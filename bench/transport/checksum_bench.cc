// checksum_bench: the bucket checksum (transport/tcp/wire_format.h) against
// memcpy, in cache and from memory, measured in the same run.
//
// The TCP channel checksums each piece of a bucket just before the kernel
// copies it to the socket (sender) and just after the kernel copied it in
// (receiver), so what the checksum costs per byte, next to a copy of the
// same bytes, is what it takes from the transfer on a host whose cores are
// all busy. Both loops are timed: the one ferry runs (AVX2 where the CPU
// has it) and the portable one.
//
//   bazel run -c opt //bench/transport:checksum_bench
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "transport/tcp/wire_format.h"

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;

// GB/s of `fn` over `bytes`, best of `rounds`, each round `repeat` calls.
template <typename Fn>
double Best(int64_t bytes, int repeat, int rounds, Fn fn) {
  double best = 0;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = Clock::now();
    for (int i = 0; i < repeat; ++i) fn();
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    best = std::max(best, static_cast<double>(bytes) * repeat / s / 1e9);
  }
  return best;
}

int Main() {
  constexpr int64_t kCache = 256 << 10;  // the channel's segment
  constexpr int64_t kMemory = int64_t{512} << 20;
  std::unique_ptr<uint8_t[]> src(new uint8_t[kMemory]);
  std::unique_ptr<uint8_t[]> dst(new uint8_t[kMemory]);
  for (int64_t i = 0; i < kMemory; ++i) src[i] = static_cast<uint8_t>(i * 7);
  std::memset(dst.get(), 0, kMemory);
  volatile uint64_t sink = 0;

  std::printf("checksum_bench: GB/s, best of 5\n");
  std::printf("%-34s %12s %12s\n", "", "in cache", "from memory");
  std::printf("%-34s %12s %12s\n", "", "(256 KiB)", "(512 MiB)");
  const double copy_cache = Best(kCache, 4096, 5, [&] {
    std::memcpy(dst.get(), src.get(), kCache);
  });
  const double copy_memory = Best(kMemory, 1, 5, [&] {
    std::memcpy(dst.get(), src.get(), kMemory);
  });
  std::printf("%-34s %12.1f %12.1f\n", "memcpy", copy_cache, copy_memory);
  const double sum_cache = Best(kCache, 4096, 5, [&] {
    sink = sink + ChecksumOf(src.get(), kCache);
  });
  const double sum_memory = Best(kMemory, 1, 5, [&] {
    sink = sink + ChecksumOf(src.get(), kMemory);
  });
  std::printf("%-34s %12.1f %12.1f\n", "PayloadChecksum (as ferry runs it)",
              sum_cache, sum_memory);
  const double port_cache = Best(kCache, 4096, 5, [&] {
    sink = sink + PortableChecksumOf(src.get(), kCache);
  });
  const double port_memory = Best(kMemory, 1, 5, [&] {
    sink = sink + PortableChecksumOf(src.get(), kMemory);
  });
  std::printf("%-34s %12.1f %12.1f\n", "PayloadChecksum, portable loop",
              port_cache, port_memory);
  std::printf("checksum / memcpy: %.2fx in cache, %.2fx from memory\n",
              sum_cache / copy_cache, sum_memory / copy_memory);
  return 0;
}

}  // namespace
}  // namespace ferry

int main() { return ferry::Main(); }
