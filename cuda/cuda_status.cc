#include "cuda/cuda_status.h"

#include "absl/strings/str_cat.h"

namespace ferry {
namespace gpu {
namespace {

absl::StatusCode CudaCode(cudaError_t error) {
  switch (error) {
    case cudaErrorMemoryAllocation:
      return absl::StatusCode::kResourceExhausted;
    case cudaErrorInsufficientDriver:
    case cudaErrorNoDevice:
    case cudaErrorDevicesUnavailable:
    case cudaErrorInitializationError:
    case cudaErrorStubLibrary:
    case cudaErrorSystemDriverMismatch:
    case cudaErrorCompatNotSupportedOnDevice:
      return absl::StatusCode::kUnavailable;
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidConfiguration:
      return absl::StatusCode::kInvalidArgument;
    case cudaErrorNotSupported:
      return absl::StatusCode::kUnimplemented;
    default:
      return absl::StatusCode::kInternal;
  }
}

absl::StatusCode NcclCode(ncclResult_t result) {
  switch (result) {
    case ncclInvalidArgument:
    case ncclInvalidUsage:
      return absl::StatusCode::kInvalidArgument;
    case ncclRemoteError:
    case ncclSystemError:
      return absl::StatusCode::kUnavailable;
    default:
      return absl::StatusCode::kInternal;
  }
}

}  // namespace

absl::Status CudaStatus(cudaError_t error, absl::string_view call) {
  if (error == cudaSuccess) return absl::OkStatus();
  // Clear the sticky "last error" so the next unrelated call does not see
  // it again (a no-op for sticky context errors, which stay anyway).
  (void)cudaGetLastError();
  return absl::Status(CudaCode(error),
                      absl::StrCat(call, ": ", cudaGetErrorString(error), " (",
                                   cudaGetErrorName(error), ")"));
}

absl::Status NcclStatus(ncclResult_t result, absl::string_view call) {
  if (result == ncclSuccess || result == ncclInProgress) {
    return absl::OkStatus();
  }
  return absl::Status(NcclCode(result),
                      absl::StrCat(call, ": ", ncclGetErrorString(result),
                                   " (ncclResult ", static_cast<int>(result),
                                   ")"));
}

}  // namespace gpu
}  // namespace ferry
