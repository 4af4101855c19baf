// fp8_bench: what quantizing a bf16 weight to FP8 with 128x128 block
// scales costs on the CPU (core/fp8_blocks.h), against memcpy of the same
// bf16 bytes in the same run (the physical limit on this machine), per
// GB of source. Median and spread of --runs runs. Also what a tensor split
// over trainer nodes costs its holders together (core/fp8_split.h): the
// block amax pass (BlockAbsMaxBits), then quantizing with the combined
// amaxes (QuantizeBlocksWithAmax).
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
#include "core/fp8_split.h"
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

// The weight split as FSDP over two trainer nodes would hold it, rows
// [0, cut) on "a" and the rest on "b" (cut mid-block), through
// core/fp8_split.h as ferryd runs it: each node's amax pass, then each
// node's parts with the combined grid (band copies included). Milliseconds.
double SplitMs(const std::vector<uint16_t>& src, const Fp8BlockShape& shape,
               std::vector<uint8_t>* out, std::vector<float>* scales) {
  ModelSpec model;
  model.params = {{"w", DType::kBF16, {shape.rows, shape.cols}},
                  {"w@fp8", DType::kF8E4M3, {shape.rows, shape.cols}},
                  {"w@scale", DType::kF32,
                   {shape.block_grid_rows(), shape.block_grid_cols()}}};
  model.BuildIndex();
  const int64_t cut = shape.rows * 3 / 7 + 5;
  const Box boxes[2] = {Box{{0, 0}, {cut, shape.cols}},
                        Box{{cut, 0}, {shape.rows - cut, shape.cols}}};
  QuantizedParam q;
  q.param = 0;
  q.fp8_param = 1;
  q.scale_param = 2;
  q.node = "b";
  std::vector<Piece> pieces;
  for (int k = 0; k < 2; ++k) {
    q.parts.push_back(QuantizedPart{k == 0 ? "a" : "b", k, boxes[k],
                                    boxes[k].offset[0] * shape.cols});
    pieces.push_back(Piece::Contiguous(0, boxes[k], 0,
                                       boxes[k].offset[0] * shape.cols * 2,
                                       DType::kBF16));
  }
  // Each node reads its own piece: rank k, readable on node k only.
  std::vector<HeldPiece> held = {{0, &pieces[0]}, {1, &pieces[1]}};
  const auto* base = reinterpret_cast<const uint8_t*>(src.data());
  const std::vector<std::vector<const uint8_t*>> on[2] = {{{base}, {nullptr}},
                                                          {{nullptr}, {base}}};
  std::vector<uint32_t> bits(scales->size(), 0);
  const double t0 = bench::WallMs();
  for (int k = 0; k < 2; ++k) {
    if (!PartialAmax(model, q, q.parts[k].node, held, on[k], bits.data()).ok()) {
      return -1;
    }
  }
  for (int k = 0; k < 2; ++k) {
    if (!QuantizeParts(model, q, q.parts[k].node, held, on[k], bits.data(),
                       out->data(),
                       k == 1 ? reinterpret_cast<uint8_t*>(scales->data())
                              : nullptr)
             .ok()) {
      return -1;
    }
  }
  return bench::WallMs() - t0;
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
  std::vector<uint32_t> max_bits(scales.size());
  std::vector<double> memcpy_ms, quant_ms, amax_ms, given_ms, split_ms;
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
    if (!BlockAbsMaxBits(src.data(), DType::kBF16, shape, max_bits.data())
             .ok()) {
      return 1;
    }
    double t3 = bench::WallMs();
    if (!QuantizeBlocksWithAmax(src.data(), DType::kBF16, shape,
                                DType::kF8E4M3, max_bits.data(), out.data(),
                                scales.data())
             .ok()) {
      return 1;
    }
    double t4 = bench::WallMs();
    const double split = SplitMs(src, shape, &out, &scales);
    if (split < 0) return 1;
    if (r == 0) continue;
    split_ms.push_back(split);
    memcpy_ms.push_back(t1 - t0);
    quant_ms.push_back(t2 - t1);
    amax_ms.push_back(t3 - t2);
    given_ms.push_back(t4 - t3);
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
  const double a = Median(amax_ms), g = Median(given_ms);
  std::printf(
      "  split over nodes: amax pass median %.2f ms (%.2f-%.2f), quantize "
      "with combined amaxes median %.2f ms (%.2f-%.2f); together %.3fx "
      "memcpy, %.2fx the whole tensor's quantize\n",
      a, *std::min_element(amax_ms.begin(), amax_ms.end()),
      *std::max_element(amax_ms.begin(), amax_ms.end()), g,
      *std::min_element(given_ms.begin(), given_ms.end()),
      *std::max_element(given_ms.begin(), given_ms.end()), m / (a + g),
      (a + g) / q);
  const double sp = Median(split_ms);
  std::printf(
      "  split over 2 nodes through core/fp8_split.h (whole rows read in place): "
      "median %.2f ms (%.2f-%.2f), %.3fx memcpy, %.2fx the whole tensor's\n",
      sp, *std::min_element(split_ms.begin(), split_ms.end()),
      *std::max_element(split_ms.begin(), split_ms.end()), m / sp, sp / q);
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
