// The one place where CUDA and NCCL error codes become absl::Status.
//
// Every CUDA runtime or NCCL call in cuda/ goes through CudaStatus or
// NcclStatus (usually via the RETURN_IF macros), so an error names the call
// that failed and the vendor's own description of the code:
//   "cudaIpcOpenMemHandle(device 1): invalid argument (cudaErrorInvalidValue)"
// Codes map to the StatusCode a caller can act on: out of memory is
// RESOURCE_EXHAUSTED, a missing driver or device is UNAVAILABLE, a bad
// argument is INVALID_ARGUMENT, a remote peer's failure is UNAVAILABLE and
// everything else INTERNAL.
#ifndef FERRY_CUDA_CUDA_STATUS_H_
#define FERRY_CUDA_CUDA_STATUS_H_

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ferry {
namespace gpu {

// OK for cudaSuccess; otherwise an error naming `call`.
absl::Status CudaStatus(cudaError_t error, absl::string_view call);
// OK for ncclSuccess and ncclInProgress (a non-blocking communicator's
// normal answer; the caller polls ncclCommGetAsyncError).
absl::Status NcclStatus(ncclResult_t result, absl::string_view call);

}  // namespace gpu
}  // namespace ferry

// Evaluates a CUDA runtime call; returns its Status from the enclosing
// function when it fails. `what` adds context ("device 0").
#define FERRY_CUDA_RETURN_IF_ERROR(call)                                  \
  do {                                                                    \
    const absl::Status ferry_cuda_status_ =                               \
        ::ferry::gpu::CudaStatus((call), #call);                          \
    if (!ferry_cuda_status_.ok()) return ferry_cuda_status_;              \
  } while (false)

#define FERRY_NCCL_RETURN_IF_ERROR(call)                                  \
  do {                                                                    \
    const absl::Status ferry_nccl_status_ =                               \
        ::ferry::gpu::NcclStatus((call), #call);                          \
    if (!ferry_nccl_status_.ok()) return ferry_nccl_status_;              \
  } while (false)

#endif  // FERRY_CUDA_CUDA_STATUS_H_
