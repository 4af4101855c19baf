// fp8_bench: what quantizing a bf16 weight to FP8 with 128x128 block
// scales costs on the CPU (core/fp8_blocks.h), against memcpy of the same
// bf16 bytes in the same run (the physical limit on this machine), per
// GB of source. Median and spread of --runs runs.
//
//   bazel run -c opt //bench:fp8_bench -- [--rows=7168] [--cols=2048] [--runs=7]
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "bench/clocks.h"
#include "common/flags_help.h"
#include "core/fp8_blocks.h"
#include "gflags/gflags.h"

DEFINE_int64(rows, 7168, "rows of the weight (DeepSeek-V3's hidden size)");
DEFINE_int64(cols, 2048, "columns of the weight");
DEFINE_int32(runs, 7, "timed runs of each");

namespace ferry {
namespace {

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int Main() {
  const int64_t n = FLAGS_rows * FLAGS_cols;
  std::vector<uint16_t> src(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0, 0.02f);
  for (uint16_t& v : src) {
    const float f = normal(rng);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    v = static_cast<uint16_t>(u >> 16);
  }
  std::vector<uint16_t> copy(n);
  std::vector<uint8_t> out(n);
  Fp8BlockShape shape{FLAGS_rows, FLAGS_cols, 128, 128};
  std::vector<float> scales(shape.block_grid_rows() * shape.block_grid_cols());
  std::vector<double> memcpy_ms, quant_ms;
  for (int r = 0; r < FLAGS_runs + 1; ++r) {  // the first warms up
    double t0 = bench::WallMs();
    std::memcpy(copy.data(), src.data(), n * 2);
    double t1 = bench::WallMs();
    if (!QuantizeBlocks(src.data(), DType::kBF16, shape, DType::kF8E4M3,
                        out.data(), scales.data())
             .ok()) {
      return 1;
    }
    double t2 = bench::WallMs();
    if (r == 0) continue;
    memcpy_ms.push_back(t1 - t0);
    quant_ms.push_back(t2 - t1);
  }
  const double gb = n * 2 / 1e9;
  const double m = Median(memcpy_ms), q = Median(quant_ms);
  std::printf(
      "fp8_bench: bf16 [%lld, %lld] (%.1f MB) -> e4m3 + 128x128 scales, "
      "%d runs, 1 thread\n"
      "  memcpy   median %.2f ms (%.2f-%.2f), %.2f GB/s\n"
      "  quantize median %.2f ms (%.2f-%.2f), %.2f GB/s of bf16 = %.3fx memcpy\n",
      static_cast<long long>(FLAGS_rows), static_cast<long long>(FLAGS_cols),
      gb * 1e3, FLAGS_runs, m,
      *std::min_element(memcpy_ms.begin(), memcpy_ms.end()),
      *std::max_element(memcpy_ms.begin(), memcpy_ms.end()), gb / m * 1e3, q,
      *std::min_element(quant_ms.begin(), quant_ms.end()),
      *std::max_element(quant_ms.begin(), quant_ms.end()), gb / q * 1e3, m / q);
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "FP8 block quantization on the CPU against memcpy:\n"
      "  fp8_bench [--rows=7168] [--cols=2048] [--runs=7]");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  return ferry::Main();
}
