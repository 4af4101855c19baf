// Probing for a usable GPU: whether the CUDA backends are viable here.
//
// Like TensorPipe's isViable(), a GPU backend first asks whether it can run
// at all, and says "not here" (a status a caller can recognise) instead of
// failing half way. A machine without a driver or without a device answers
// NotViable with the reason CUDA gave; nothing here ever aborts the process,
// whatever state the driver is in.
//
// Threading: thread-safe. The probe runs once per process and is cached
// (CUDA's own answer does not change while the process lives).
#ifndef FERRY_CUDA_DEVICE_H_
#define FERRY_CUDA_DEVICE_H_

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {
namespace gpu {

// What the probe found.
struct DeviceProbe {
  int driver_version = 0;   // cudaDriverGetVersion, e.g. 13000; 0: none
  int runtime_version = 0;  // cudaRuntimeGetVersion
  int device_count = 0;
};

// OK when the CUDA driver is loaded and at least one device is visible;
// otherwise a NotViable status whose message says why ("no GPU:
// cudaGetDeviceCount: CUDA driver version is insufficient ...").
absl::Status IsViable();
// The probe itself; never an error (a failed probe has device_count 0).
DeviceProbe ProbeDevices();

// NotViable: UNAVAILABLE with a payload that marks it, so that callers can
// tell "this backend cannot run here" from an error of a backend that runs.
absl::Status NotViableError(absl::string_view reason);
bool IsNotViable(const absl::Status& status);

// Checks `device` is a valid ordinal and makes it current on the calling
// thread (CUDA's current device is per thread: every entry point that
// touches a device calls this first).
absl::Status UseDevice(int device);

// The GPU's UUID as nvidia-smi prints it: "GPU-" then 32 hex digits in
// groups of 8-4-4-4-12. Clients name their GPU by it (types.proto Device),
// since ordinals differ between processes (CUDA_VISIBLE_DEVICES).
absl::StatusOr<std::string> DeviceUuid(int device);

// "NVIDIA H200 (device 0, sm_90, 139.8 GiB)", or the error.
absl::StatusOr<std::string> DescribeDevice(int device);

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_DEVICE_H_
