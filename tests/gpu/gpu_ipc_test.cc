// The cuda_ipc backend on a GPU, beyond the conformance suite (which runs
// the engine on device buffers in gpu_conformance_test): the registration
// cache opens a real IPC allocation (exported by a second process) once
// however often it is registered, and the engine copies a strided box out
// of the IPC mapping, checked byte by byte on the host.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <vector>

#include "cuda/device.h"
#include "cuda/ipc/cuda_ipc_copy_engine.h"
#include "cuda/ipc/ipc_memory_cache.h"
#include "tests/gpu/device_buffers.h"
#include "tests/gpu/exporter_process.h"

namespace ferry {
namespace {

using gpu_testing::DeviceBuffer;

std::unique_ptr<CopyEngine> MakeEngine() {
  absl::StatusOr<std::unique_ptr<CopyEngine>> e = CreateCudaIpcCopyEngine();
  INFO(e.status().ToString());
  REQUIRE(e.ok());
  return *std::move(e);
}

TEST_CASE("ipc cache: an allocation registered 100 times is opened once", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = 1 << 20;
  gpu_testing::ExporterProcess exporter;
  absl::StatusOr<std::string> handle = exporter.Start(kBytes);
  INFO(handle.status().ToString());
  REQUIRE(handle.ok());
  gpu::IpcMemoryCache cache(gpu::CreateCudaIpcMapper());
  uint8_t* base = nullptr;
  for (int i = 0; i < 100; ++i) {
    absl::StatusOr<uint8_t*> b = cache.Register(0, *handle);
    INFO(b.status().ToString());
    REQUIRE(b.ok());
    if (i == 0) base = *b;
    CHECK(*b == base);
  }
  CHECK(cache.opens() == 1);
  CHECK(cache.size() == 1);
  // The mapping shows the other process's bytes.
  std::vector<uint8_t> got(kBytes);
  FERRY_CUDA_CHECK(cudaMemcpy(got.data(), base, kBytes, cudaMemcpyDeviceToHost));
  size_t wrong = 0;
  for (size_t i = 0; i < kBytes; ++i) {
    wrong += got[i] != gpu_testing::ExporterProcess::PatternByte(i);
  }
  CHECK(wrong == 0);
  for (int i = 0; i < 100; ++i) REQUIRE(cache.Deregister(0, *handle).ok());
  CHECK(cache.size() == 0);
  // Registering again opens again: nothing stale was kept.
  REQUIRE(cache.Register(0, *handle).ok());
  CHECK(cache.opens() == 2);
}

TEST_CASE("cuda_ipc engine: copies a strided box out of an IPC mapping", "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  constexpr size_t kBytes = 4 << 20;
  gpu_testing::ExporterProcess exporter;
  absl::StatusOr<std::string> handle = exporter.Start(kBytes);
  REQUIRE(handle.ok());
  gpu::IpcMemoryCache cache(gpu::CreateCudaIpcMapper());
  absl::StatusOr<uint8_t*> base = cache.Register(0, *handle);
  REQUIRE(base.ok());
  // Column block [512, 256:768] of a bf16 [1024, 2048] matrix.
  DeviceBuffer dst(512 * 512 * 2);
  LocalCopy c{{*base + 256 * 2, {2048, 1}}, {dst.get(), {512, 1}}, {512, 512}, 2};
  auto engine = MakeEngine();
  REQUIRE(engine->Run({c}).ok());
  const std::vector<uint8_t> got = dst.Download();
  size_t wrong = 0;
  for (size_t r = 0; r < 512; ++r) {
    for (size_t b = 0; b < 1024; ++b) {
      wrong += got[r * 1024 + b] !=
               gpu_testing::ExporterProcess::PatternByte(r * 4096 + 512 + b);
    }
  }
  CHECK(wrong == 0);
}

}  // namespace
}  // namespace ferry
