// GpuMirror with CUDA (gpu_mirror.h).
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "examples/demo/gpu_mirror.h"
#include "cuda/cuda_status.h"
#include "cuda/device.h"
#include "cuda/ipc/ipc_memory_cache.h"

namespace ferry {
namespace {

class CudaMirror final : public GpuMirror {
 public:
  CudaMirror(int device, void* data, int64_t bytes, std::string uuid,
             std::string handle)
      : device_(device),
        data_(data),
        bytes_(bytes),
        uuid_(std::move(uuid)),
        handle_(std::move(handle)) {}
  ~CudaMirror() override {
    if (gpu::UseDevice(device_).ok()) (void)cudaFree(data_);
  }

  absl::Status Upload(const uint8_t* host) override {
    if (absl::Status s = gpu::UseDevice(device_); !s.ok()) return s;
    return gpu::CudaStatus(
        cudaMemcpy(data_, host, static_cast<size_t>(bytes_),
                   cudaMemcpyHostToDevice),
        "cudaMemcpy (upload)");
  }
  absl::Status Download(uint8_t* host) override {
    if (absl::Status s = gpu::UseDevice(device_); !s.ok()) return s;
    return gpu::CudaStatus(
        cudaMemcpy(host, data_, static_cast<size_t>(bytes_),
                   cudaMemcpyDeviceToHost),
        "cudaMemcpy (download)");
  }
  v1::MemoryRegion Describe(uint32_t region_id) const override {
    v1::MemoryRegion r;
    r.set_region_id(region_id);
    r.set_size_bytes(bytes_);
    v1::CudaIpcRegion* ipc = r.mutable_cuda_ipc();
    ipc->set_ipc_handle(handle_);
    ipc->set_allocation_offset_bytes(0);
    ipc->mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
    ipc->mutable_device()->set_cuda_uuid(uuid_);
    ipc->mutable_device()->set_cuda_ordinal(device_);
    return r;
  }

 private:
  const int device_;
  void* const data_;
  const int64_t bytes_;
  const std::string uuid_;
  const std::string handle_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<GpuMirror>> GpuMirror::Create(
    const std::string& device, int64_t bytes) {
  int ordinal = -1;
  if (!absl::StartsWith(device, "cuda:") ||
      !absl::SimpleAtoi(device.substr(5), &ordinal) || ordinal < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--device=", device, ": expected host or cuda:N"));
  }
  if (absl::Status s = gpu::UseDevice(ordinal); !s.ok()) return s;
  absl::StatusOr<std::string> uuid = gpu::DeviceUuid(ordinal);
  if (!uuid.ok()) return uuid.status();
  void* data = nullptr;
  if (absl::Status s = gpu::CudaStatus(
          cudaMalloc(&data, static_cast<size_t>(std::max<int64_t>(bytes, 1))),
          absl::StrCat("cudaMalloc(", bytes, " bytes on ", device, ")"));
      !s.ok()) {
    return s;
  }
  absl::StatusOr<std::string> handle = gpu::ExportCudaIpcHandle(data);
  if (!handle.ok()) {
    (void)cudaFree(data);
    return handle.status();
  }
  return std::unique_ptr<GpuMirror>(new CudaMirror(
      ordinal, data, std::max<int64_t>(bytes, 1), *std::move(uuid),
      *std::move(handle)));
}

}  // namespace ferry
