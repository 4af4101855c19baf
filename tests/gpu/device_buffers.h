// Device-side helpers for the GPU tests: the visible skip, device buffers,
// the conformance suite's buckets (tests/transport/transport_conformance.h)
// mirrored in device memory, and DeviceTestMemory, which runs that suite
// against GPU backends.
#ifndef FERRY_TESTS_GPU_DEVICE_BUFFERS_H_
#define FERRY_TESTS_GPU_DEVICE_BUFFERS_H_

#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "cuda/device.h"
#include "tests/transport/transport_conformance.h"

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

// A conformance bucket whose source and destination also live on the
// device (for the kernels, which take device addresses directly).
struct DeviceBucket {
  testing::TestBucket host;
  DeviceBuffer src, dst;

  explicit DeviceBucket(testing::TestBucket b)
      : host(std::move(b)),
        src(std::max<size_t>(host.src.size(), 1)),
        dst(std::max<size_t>(host.dst.size(), 1)) {
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
  void CheckArrived() {
    std::vector<uint8_t> got = dst.Download();
    got.resize(host.dst.size());
    host.dst = std::move(got);
    testing::CheckArrived(host);
  }
};

// The conformance suite's buffers on GPU 0: Place uploads both, Fetch
// downloads the destination. Unavailable without a GPU.
class DeviceTestMemory : public testing::TestMemory {
 public:
  std::string Unavailable() const override {
    const absl::Status viable = gpu::IsViable();
    return viable.ok() ? ""
                       : "no GPU (" + std::string(viable.message()) + ")";
  }
  void Place(testing::TestBucket& b) override {
    auto buffers = std::make_shared<std::pair<DeviceBuffer, DeviceBuffer>>(
        DeviceBuffer(std::max<size_t>(b.src.size(), 1)),
        DeviceBuffer(std::max<size_t>(b.dst.size(), 1)));
    buffers->first.Upload(b.src);
    buffers->second.Upload(b.dst);
    b.placed_src = buffers->first.get();
    b.placed_dst = buffers->second.get();
    b.placement = buffers;
  }
  // May run on a sender thread: no Catch2 assertion here (a failed upload
  // shows as wrong bytes at the receiver).
  void UpdateSource(testing::TestBucket& b) override {
    if (b.placed_src != nullptr && !b.src.empty()) {
      (void)cudaMemcpy(b.placed_src, b.src.data(), b.src.size(),
                       cudaMemcpyHostToDevice);
    }
  }
  void Fetch(testing::TestBucket& b) override {
    if (b.placed_dst == nullptr || b.dst.empty()) return;
    FERRY_CUDA_CHECK(cudaMemcpy(b.dst.data(), b.placed_dst, b.dst.size(),
                                cudaMemcpyDeviceToHost));
  }
};

inline DeviceTestMemory& DeviceMemoryForTests() {
  static DeviceTestMemory* memory = new DeviceTestMemory();
  return *memory;
}

}  // namespace gpu_testing
}  // namespace ferry

#endif  // FERRY_TESTS_GPU_DEVICE_BUFFERS_H_
