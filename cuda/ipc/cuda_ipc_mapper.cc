// The CUDA implementation of IpcMapper, and handle export.
#include <cuda_runtime_api.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "cuda/cuda_status.h"
#include "cuda/device.h"
#include "cuda/ipc/ipc_memory_cache.h"

namespace ferry {
namespace gpu {
namespace {

static_assert(sizeof(cudaIpcMemHandle_t) == kCudaIpcHandleBytes,
              "kCudaIpcHandleBytes must match the CUDA headers");

class CudaIpcMapper final : public IpcMapper {
 public:
  absl::StatusOr<uint8_t*> Open(int device,
                                absl::string_view handle) override {
    if (handle.size() != kCudaIpcHandleBytes) {
      return absl::InvalidArgumentError("malformed CUDA IPC handle");
    }
    if (absl::Status s = UseDevice(device); !s.ok()) return s;
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* base = nullptr;
    if (absl::Status s = CudaStatus(
            cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess),
            absl::StrCat("cudaIpcOpenMemHandle(device ", device, ")"));
        !s.ok()) {
      return s;
    }
    return static_cast<uint8_t*>(base);
  }

  absl::Status Close(int device, uint8_t* base) override {
    if (absl::Status s = UseDevice(device); !s.ok()) return s;
    return CudaStatus(
        cudaIpcCloseMemHandle(base),
        absl::StrCat("cudaIpcCloseMemHandle(device ", device, ")"));
  }
};

}  // namespace

std::unique_ptr<IpcMapper> CreateCudaIpcMapper() {
  return std::make_unique<CudaIpcMapper>();
}

absl::StatusOr<std::string> ExportCudaIpcHandle(const void* device_ptr) {
  if (absl::Status s = IsViable(); !s.ok()) return s;
  cudaIpcMemHandle_t h;
  FERRY_CUDA_RETURN_IF_ERROR(
      cudaIpcGetMemHandle(&h, const_cast<void*>(device_ptr)));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

}  // namespace gpu
}  // namespace ferry
