// ferryd's DeviceMemory on a real GPU (cuda/gpu_device_memory.h): client
// regions named by a CUDA IPC handle from another process are mapped at
// their offset, a region past the allocation's end or on an unknown GPU is
// refused at registration, and the GPU's engine copies out of a mapping
// into device memory and into pinned host memory (fallback staging). Bytes
// are checked against the exporter's own pattern.
#include <cuda_runtime_api.h>
#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <vector>

#include "cuda/device.h"
#include "cuda/gpu_device_memory.h"
#include "tests/gpu/device_buffers.h"
#include "tests/gpu/exporter_process.h"

namespace ferry {
namespace {

using gpu_testing::ExporterProcess;

constexpr int64_t kAllocation = 1 << 20;

IpcRegion Region(const std::string& handle, const std::string& uuid,
                 int64_t offset) {
  return IpcRegion{handle, offset, uuid};
}

// One contiguous copy of `bytes` bytes.
LocalCopy Contiguous(uint8_t* src, uint8_t* dst, int64_t bytes) {
  LocalCopy c;
  c.src.base = src;
  c.src.strides = {1};
  c.dst.base = dst;
  c.dst.strides = {1};
  c.extent = {bytes};
  c.unit_bytes = 1;
  return c;
}

}  // namespace

TEST_CASE("GPU DeviceMemory maps, bounds-checks and copies client regions",
          "[gpu]") {
  FERRY_SKIP_WITHOUT_GPU();
  absl::StatusOr<std::unique_ptr<DeviceMemory>> created =
      gpu::CreateGpuDeviceMemory();
  INFO(created.status().ToString());
  REQUIRE(created.ok());
  DeviceMemory& gpus = **created;
  REQUIRE(gpus.Available().ok());
  REQUIRE_FALSE(gpus.Devices().empty());
  absl::StatusOr<std::string> uuid = gpu::DeviceUuid(0);
  REQUIRE(uuid.ok());
  CHECK(gpus.Devices()[0].uuid == *uuid);
  CHECK(uuid->rfind("GPU-", 0) == 0);
  CHECK(uuid->size() == 4 + 36);

  ExporterProcess exporter;
  absl::StatusOr<std::string> handle = exporter.Start(kAllocation);
  INFO(handle.status().ToString());
  REQUIRE(handle.ok());

  // Two regions of one allocation: one mapping, at their offsets.
  absl::StatusOr<std::unique_ptr<DeviceRegion>> a =
      gpus.Map(Region(*handle, *uuid, 0), 4096);
  absl::StatusOr<std::unique_ptr<DeviceRegion>> b =
      gpus.Map(Region(*handle, *uuid, 8192), 4096);
  INFO(a.status().ToString() << " / " << b.status().ToString());
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK((*b)->data() - (*a)->data() == 8192);
  CHECK((*a)->gpu() == 0);

  SECTION("a region past the end of its allocation is INVALID_ARGUMENT") {
    absl::StatusOr<std::unique_ptr<DeviceRegion>> past =
        gpus.Map(Region(*handle, *uuid, kAllocation - 100), 4096);
    CHECK(past.status().code() == absl::StatusCode::kInvalidArgument);
    CHECK(past.status().message().find("past the end") != std::string::npos);
  }
  SECTION("a GPU this process does not see is FAILED_PRECONDITION") {
    absl::StatusOr<std::unique_ptr<DeviceRegion>> elsewhere =
        gpus.Map(Region(*handle, "GPU-elsewhere", 0), 4096);
    CHECK(elsewhere.status().code() == absl::StatusCode::kFailedPrecondition);
  }
  SECTION("a handle that names nothing is INVALID_ARGUMENT") {
    absl::StatusOr<std::unique_ptr<DeviceRegion>> junk =
        gpus.Map(Region(std::string(64, '\x5a'), *uuid, 0), 4096);
    CHECK(junk.status().code() == absl::StatusCode::kInvalidArgument);
  }
  SECTION("the GPU's engine copies into device memory and pinned host memory") {
    CopyEngine* engine = gpus.Engine(0);
    REQUIRE(engine != nullptr);
    CHECK(gpus.Engine(static_cast<int>(gpus.Devices().size())) == nullptr);

    gpu_testing::DeviceBuffer device(4096);
    REQUIRE(engine->Run({Contiguous((*a)->data(),
                                    static_cast<uint8_t*>(device.get()), 4096)})
                .ok());
    std::vector<uint8_t> got(4096);
    FERRY_CUDA_CHECK(
        cudaMemcpy(got.data(), device.get(), 4096, cudaMemcpyDeviceToHost));
    int wrong = 0;
    for (int i = 0; i < 4096; ++i) {
      wrong += got[i] != ExporterProcess::PatternByte(i);
    }
    CHECK(wrong == 0);

    // Staging: shared host memory, pinned, written by the kernel.
    void* host = mmap(nullptr, 4096, PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    REQUIRE(host != MAP_FAILED);
    {
      absl::StatusOr<std::unique_ptr<PinnedHost>> pin =
          gpus.PinHost(static_cast<uint8_t*>(host), 4096, /*read_only=*/false);
      INFO(pin.status().ToString());
      REQUIRE(pin.ok());
      absl::Status s = engine->Run(
          {Contiguous((*b)->data(), static_cast<uint8_t*>(host), 4096)});
      INFO(s.ToString());
      REQUIRE(s.ok());
      const uint8_t* h = static_cast<const uint8_t*>(host);
      wrong = 0;
      for (int i = 0; i < 4096; ++i) {
        wrong += h[i] != ExporterProcess::PatternByte(8192 + i);
      }
      CHECK(wrong == 0);
    }
    munmap(host, 4096);
  }
}

}  // namespace ferry
