// patch_bench: what delta versions cost the sending daemon per GB, against
// memcpy of the same bytes in the same run (issue 42).
//
// A 512 MiB bf16 source buffer and its shadow (as of the version before),
// a fraction of the elements changed (strided, every 1/density-th). Timed,
// each the median of --runs:
//   diff   DiffIntoShadow (daemon/transfer/delta_shadows.h): the pass the
//          first route of a version makes over a buffer, finding the
//          changed 2-byte chunks and writing them into the shadow;
//   patch  PlanPatch + WritePatch (transport/bucket_patch.h) of the whole
//          buffer as 64 MiB buckets (what every route pays per bucket);
//   apply  ParsePatch + ApplyPatch of those patches (the receiver);
//   memcpy of the buffer (the yardstick: what a dense send's copy costs).
//
//   bazel run -c opt //bench/daemon:patch_bench -- [--mib=512] [--runs=5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <vector>

#include "daemon/transfer/delta_shadows.h"
#include "gflags/gflags.h"
#include "transport/bucket_patch.h"

DEFINE_int64(mib, 512, "buffer size, MiB");
DEFINE_int32(runs, 5, "runs of each step; the median is reported");

namespace ferry {
namespace {

using Clock = std::chrono::steady_clock;

template <typename Fn>
double MedianSeconds(int runs, Fn fn) {
  std::vector<double> t;
  for (int r = 0; r < runs; ++r) {
    const auto t0 = Clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

BucketView Flat(uint8_t* data, int64_t bytes, int64_t unit) {
  BucketView v;
  v.regions.push_back(RegionView{data, {1}});
  v.extents.push_back({bytes / unit});
  v.unit_bytes.push_back(unit);
  v.bytes = bytes;
  return v;
}

int Main() {
  const int64_t n = FLAGS_mib << 20;
  constexpr int64_t kBucket = int64_t{64} << 20;
  std::vector<uint8_t> now(n), shadow(n), copy(n), dst(n);
  for (int64_t i = 0; i < n; ++i) now[i] = static_cast<uint8_t>(i * 131);
  std::vector<uint64_t> bits((n / 2 + 63) / 64);
  const double gb = n / 1e9;
  const double memcpy_s =
      MedianSeconds(FLAGS_runs, [&] { std::memcpy(copy.data(), now.data(), n); });
  std::printf("patch_bench: %ld MiB of bf16, 64 MiB buckets; memcpy %.1f ms "
              "(%.2f GB/s), median of %d\n",
              static_cast<long>(FLAGS_mib), memcpy_s * 1e3, gb / memcpy_s,
              FLAGS_runs);
  std::printf("%9s %12s %12s %12s %12s %14s\n", "density", "diff ms",
              "patch ms", "apply ms", "patch bytes", "(diff+patch)/memcpy");
  for (double density : {0.0, 0.001, 0.01, 0.05, 0.5, 1.0}) {
    // The version before: `shadow`; this one: `now`, density of it changed.
    std::memcpy(shadow.data(), now.data(), n);
    const int64_t stride =
        density > 0 ? std::max<int64_t>(1, static_cast<int64_t>(1 / density))
                    : 0;
    if (stride > 0) {
      for (int64_t e = 0; e < n / 2; e += stride) {
        now[2 * e] = static_cast<uint8_t>(now[2 * e] + 1);
      }
    }
    const std::vector<uint8_t> before = shadow;
    std::vector<double> diffs;  // each run from the same shadow, untimed
    for (int r = 0; r < FLAGS_runs; ++r) {
      std::memcpy(shadow.data(), before.data(), n);
      const auto t0 = Clock::now();
      DiffIntoShadow(now.data(), shadow.data(), n, bits.data());
      diffs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    std::sort(diffs.begin(), diffs.end());
    const double diff = diffs[diffs.size() / 2];
    std::vector<std::vector<uint8_t>> patches(n / kBucket);
    std::vector<bool> dense(n / kBucket, false);
    int64_t patch_bytes = 0;
    const double patch = MedianSeconds(FLAGS_runs, [&] {
      patch_bytes = 0;
      for (int64_t b = 0; b < n / kBucket; ++b) {
        const BucketView v = Flat(now.data() + b * kBucket, kBucket, 2);
        const PatchPlan plan =
            PlanPatch(v, {ChunkChanges{now.data(), bits.data()}}, kBucket);
        dense[b] = plan.dense;
        if (plan.dense) {
          patch_bytes += kBucket;
          continue;
        }
        patches[b].resize(plan.bytes);
        WritePatch(v, plan, patches[b].data());
        patch_bytes += plan.bytes;
      }
    });
    const double apply = MedianSeconds(FLAGS_runs, [&] {
      for (int64_t b = 0; b < n / kBucket; ++b) {
        if (dense[b]) continue;
        const BucketView v = Flat(dst.data() + b * kBucket, kBucket, 2);
        absl::StatusOr<ParsedPatch> p =
            ParsePatch(v, patches[b].data(), patches[b].size(), "bench");
        if (p.ok()) ApplyPatch(v, *p, patches[b].data());
      }
    });
    std::printf("%8.1f%% %12.1f %12.1f %12.1f %11.1f%% %13.2fx\n",
                density * 100, diff * 1e3, patch * 1e3, apply * 1e3,
                100.0 * patch_bytes / n, (diff + patch) / memcpy_s);
  }
  std::printf("(patch bytes: the wire bytes of the buckets, dense where a "
              "patch would not be smaller; per GB divide the times by %.3f)\n",
              gb);
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return ferry::Main();
}
