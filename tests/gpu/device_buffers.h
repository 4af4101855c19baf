// Device-side helpers for the GPU tests: the visible skip, device buffers,
// and test buckets mirrored in device memory.
#ifndef FERRY_TESTS_GPU_DEVICE_BUFFERS_H_
#define FERRY_TESTS_GPU_DEVICE_BUFFERS_H_

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cuda/device.h"
#include "tests/gpu/test_buckets.h"

// Catch2 v2 has no SKIP: a test that needs a GPU returns early where there
// is none, after a line a reader (and device_check.sh) can see.
#define FERRY_SKIP_WITHOUT_GPU()                                         \
  do {                                                                   \
    const absl::Status ferry_viable_ = ::ferry::gpu::IsViable();         \
    if (!ferry_viable_.ok()) {                                           \
      const std::string ferry_reason_(ferry_viable_.message());          \
      WARN("SKIPPED: no GPU (" << ferry_reason_ << ")");                 \
      std::printf("SKIPPED: no GPU (%s)\n", ferry_reason_.c_str());      \
      return;                                                            \
    }                                                                    \
  } while (false)

#define FERRY_CUDA_CHECK(call) REQUIRE((call) == cudaSuccess)

namespace ferry {
namespace gpu_testing {

class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) FERRY_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) {
    o.ptr_ = nullptr;
    o.bytes_ = 0;
  }
  ~DeviceBuffer() {
    if (ptr_ != nullptr) (void)cudaFree(ptr_);
  }
  uint8_t* get() const { return static_cast<uint8_t*>(ptr_); }
  size_t size() const { return bytes_; }
  void Upload(const std::vector<uint8_t>& host) {
    REQUIRE(host.size() <= bytes_);
    if (!host.empty()) {
      FERRY_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), host.size(),
                                  cudaMemcpyHostToDevice));
    }
  }
  std::vector<uint8_t> Download() const {
    std::vector<uint8_t> host(bytes_);
    if (bytes_ > 0) {
      FERRY_CUDA_CHECK(
          cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost));
    }
    return host;
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// A test bucket whose source and destination live on the device.
struct DeviceBucket {
  TestBucket host;
  DeviceBuffer src, dst;

  explicit DeviceBucket(TestBucket b)
      : host(std::move(b)), src(host.src.size()), dst(host.dst.size()) {
    src.Upload(host.src);
    dst.Upload(host.dst);
  }
  BucketView SourceView() const { return host.View(src.get(), true); }
  BucketView DestinationView() const { return host.View(dst.get(), false); }
  std::vector<LocalCopy> Copies() const {
    return host.Copies(src.get(), dst.get());
  }
  // Checks the device destination against the oracle: every unit in place,
  // every other byte still the sentinel.
  void CheckArrived() const {
    const std::vector<uint8_t> got = dst.Download();
    const std::vector<uint8_t> want = ExpectedDestination(host);
    const int64_t at = FirstDifference(got, want);
    INFO("bucket " << host.id << " (" << host.boxes.size() << " boxes, "
                   << host.bytes() << " bytes): first wrong byte " << at
                   << (at >= 0 ? " got " + std::to_string(got[at]) +
                                     " want " + std::to_string(want[at])
                               : std::string()));
    CHECK(at == -1);
  }
};

}  // namespace gpu_testing
}  // namespace ferry

#endif  // FERRY_TESTS_GPU_DEVICE_BUFFERS_H_
