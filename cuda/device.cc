#include "cuda/device.h"

#include <cuda_runtime_api.h>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "cuda/cuda_status.h"

namespace ferry {
namespace gpu {
namespace {

constexpr char kNotViablePayload[] = "ferry.dev/not-viable";

struct ProbeResult {
  DeviceProbe probe;
  absl::Status status;
};

ProbeResult RunProbe() {
  ProbeResult r;
  // Both version calls are safe without a driver (they report 0 / the
  // library's version); their errors are ignored on purpose.
  if (cudaDriverGetVersion(&r.probe.driver_version) != cudaSuccess) {
    r.probe.driver_version = 0;
  }
  if (cudaRuntimeGetVersion(&r.probe.runtime_version) != cudaSuccess) {
    r.probe.runtime_version = 0;
  }
  int count = 0;
  const absl::Status s =
      CudaStatus(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  if (!s.ok()) {
    r.status = NotViableError(absl::StrCat(
        "no GPU: ", s.message(), "; driver version ", r.probe.driver_version,
        ", runtime version ", r.probe.runtime_version));
    return r;
  }
  r.probe.device_count = count;
  if (count <= 0) {
    r.status = NotViableError("no GPU: cudaGetDeviceCount reports 0 devices");
    return r;
  }
  r.status = absl::OkStatus();
  return r;
}

const ProbeResult& CachedProbe() {
  static const ProbeResult* const result = new ProbeResult(RunProbe());
  return *result;
}

}  // namespace

absl::Status NotViableError(absl::string_view reason) {
  absl::Status s = absl::UnavailableError(reason);
  s.SetPayload(kNotViablePayload, absl::Cord("1"));
  return s;
}

bool IsNotViable(const absl::Status& status) {
  return absl::IsUnavailable(status) &&
         status.GetPayload(kNotViablePayload).has_value();
}

absl::Status IsViable() { return CachedProbe().status; }

DeviceProbe ProbeDevices() { return CachedProbe().probe; }

absl::Status UseDevice(int device) {
  if (absl::Status s = IsViable(); !s.ok()) return s;
  const int count = CachedProbe().probe.device_count;
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "device ", device, " does not exist (", count, " visible)"));
  }
  return CudaStatus(cudaSetDevice(device),
                    absl::StrCat("cudaSetDevice(", device, ")"));
}

absl::StatusOr<std::string> DeviceUuid(int device) {
  if (absl::Status s = UseDevice(device); !s.ok()) return s;
  cudaDeviceProp prop;
  FERRY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  std::string uuid = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) uuid += '-';
    absl::StrAppendFormat(&uuid, "%02x",
                          static_cast<unsigned char>(prop.uuid.bytes[i]));
  }
  return uuid;
}

absl::StatusOr<std::string> DescribeDevice(int device) {
  if (absl::Status s = UseDevice(device); !s.ok()) return s;
  cudaDeviceProp prop;
  FERRY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, device));
  return absl::StrFormat("%s (device %d, sm_%d%d, %.1f GiB)", prop.name,
                         device, prop.major, prop.minor,
                         static_cast<double>(prop.totalGlobalMem) /
                             (1024.0 * 1024.0 * 1024.0));
}

}  // namespace gpu
}  // namespace ferry
