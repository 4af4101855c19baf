// End-to-end same-node GPU update: a ~1.6 GB bf16 model (16 Llama-style
// layers, hidden 2048, intermediate 5632) moves from a trainer process's
// allocation (TP=1, exported over CUDA IPC by a second process and mapped
// once through IpcMemoryCache) into two inference ranks' buffers (TP=2:
// qkv and gate_up split by rows, o and down by columns) through the
// cuda_ipc CopyEngine, one Run per version. Compared with cudaMemcpy of
// the same bytes, the lower bound for one copy per byte.
//
//   gpu_update_bench [versions, default 5]
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "cuda/device.h"
#include "cuda/ipc/cuda_ipc_copy_engine.h"
#include "cuda/ipc/ipc_memory_cache.h"
#include "tests/gpu/exporter_process.h"

namespace ferry {
namespace {

struct Tensor {
  int64_t rows, cols;  // bf16, row-major in the trainer
  bool split_rows;     // column-parallel (split dim 0) or row-parallel
};

int Main(int argc, char** argv) {
  const absl::Status viable = gpu::IsViable();
  if (!viable.ok()) {
    std::printf("SKIPPED: no GPU (%s)\n", std::string(viable.message()).c_str());
    return 0;
  }
  const int versions = argc > 1 ? std::atoi(argv[1]) : 5;
  const int64_t h = 2048, f = 5632, layers = 16;
  std::vector<Tensor> model;
  for (int l = 0; l < layers; ++l) {
    model.push_back({3 * h, h, true});   // qkv_proj
    model.push_back({h, h, false});      // o_proj
    model.push_back({2 * f, h, true});   // gate_up_proj
    model.push_back({h, f, false});      // down_proj
  }
  int64_t total = 0;
  for (const Tensor& t : model) total += t.rows * t.cols * 2;
  std::printf("%s\nmodel: %lld tensors, %.2f GB bf16, TP 1 -> TP 2\n",
              gpu::DescribeDevice(0).value_or("?").c_str(),
              static_cast<long long>(model.size()), total / 1e9);

  // The trainer's weights, in another process, mapped once.
  gpu_testing::ExporterProcess trainer;
  absl::StatusOr<std::string> handle = trainer.Start(static_cast<size_t>(total));
  if (!handle.ok()) {
    std::printf("exporter: %s\n", handle.status().ToString().c_str());
    return 1;
  }
  gpu::IpcMemoryCache cache(gpu::CreateCudaIpcMapper());
  const absl::Time open_start = absl::Now();
  absl::StatusOr<uint8_t*> src = cache.Register(0, *handle);
  if (!src.ok()) {
    std::printf("register: %s\n", src.status().ToString().c_str());
    return 1;
  }
  std::printf("IPC open: %.3f ms (once per allocation)\n",
              absl::ToDoubleMilliseconds(absl::Now() - open_start));
  uint8_t* ranks[2];
  for (uint8_t*& r : ranks) {
    if (cudaMalloc(reinterpret_cast<void**>(&r), total / 2) != cudaSuccess) {
      return 1;
    }
  }

  // The plan: every tensor's two shards.
  std::vector<LocalCopy> copies;
  int64_t src_off = 0, dst_off = 0;
  for (const Tensor& t : model) {
    for (int r = 0; r < 2; ++r) {
      LocalCopy c;
      c.unit_bytes = 2;
      if (t.split_rows) {
        c.extent = {t.rows / 2, t.cols};
        c.src = {*src + src_off + r * (t.rows / 2) * t.cols * 2, {t.cols, 1}};
        c.dst = {ranks[r] + dst_off, {t.cols, 1}};
      } else {
        c.extent = {t.rows, t.cols / 2};
        c.src = {*src + src_off + r * (t.cols / 2) * 2, {t.cols, 1}};
        c.dst = {ranks[r] + dst_off, {t.cols / 2, 1}};
      }
      copies.push_back(c);
    }
    src_off += t.rows * t.cols * 2;
    dst_off += t.rows * t.cols;  // half the tensor per rank
  }

  auto engine = CreateCudaIpcCopyEngine();
  if (!engine.ok()) return 1;
  if (!(*engine)->Run(copies).ok()) return 1;  // warm-up
  double best = 1e30, sum = 0;
  for (int v = 0; v < versions; ++v) {
    const absl::Time start = absl::Now();
    const absl::Status s = (*engine)->Run(copies);
    const double ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    if (!s.ok()) {
      std::printf("version %d: %s\n", v, s.ToString().c_str());
      return 1;
    }
    best = std::min(best, ms);
    sum += ms;
  }
  // Spot check: rank 0's first shard is the first rows of qkv_proj.
  std::vector<uint8_t> head(1 << 20);
  cudaMemcpy(head.data(), ranks[0], head.size(), cudaMemcpyDeviceToHost);
  size_t wrong = 0;
  for (size_t i = 0; i < head.size(); ++i) {
    wrong += head[i] != gpu_testing::ExporterProcess::PatternByte(i);
  }
  // The bound: one cudaMemcpy of the same bytes.
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  cudaMemcpy(ranks[0], *src, total / 2, cudaMemcpyDeviceToDevice);
  cudaEventRecord(a);
  cudaMemcpy(ranks[0], *src, total / 2, cudaMemcpyDeviceToDevice);
  cudaMemcpy(ranks[1], *src + total / 2, total / 2, cudaMemcpyDeviceToDevice);
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float memcpy_ms = 0;
  cudaEventElapsedTime(&memcpy_ms, a, b);
  const double gbs = total / (best * 1e6);
  const double memcpy_gbs = total / (memcpy_ms * 1e6);
  std::printf(
      "update via cuda_ipc engine: best %.3f ms, mean %.3f ms per version, "
      "%.1f GB/s (%zu boxes)\ncudaMemcpy of the same bytes: %.3f ms, %.1f "
      "GB/s; ratio %.2fx\nspot check: %s\n",
      best, sum / versions, gbs, copies.size(), memcpy_ms, memcpy_gbs,
      gbs / memcpy_gbs, wrong == 0 ? "ok" : "WRONG BYTES");
  std::printf("RESULT gpu_update_bench: %s\n",
              wrong == 0 ? (gbs >= 0.8 * memcpy_gbs ? "PASS" : "BELOW TARGET")
                         : "FAIL");
  for (uint8_t* r : ranks) cudaFree(r);
  return wrong == 0 ? 0 : 1;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) { return ferry::Main(argc, argv); }
