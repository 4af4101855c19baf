#include "transport/device_memory.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

class Unavailable : public DeviceMemory {
 public:
  explicit Unavailable(std::string reason) : reason_(std::move(reason)) {}

  // The bare reason (GetHealth.gpu_unavailable_reason); requests get it
  // with what they asked for.
  absl::Status Available() const override {
    return absl::FailedPreconditionError(reason_);
  }
  std::vector<GpuInfo> Devices() const override { return {}; }
  absl::StatusOr<std::unique_ptr<DeviceRegion>> Map(const IpcRegion&,
                                                    int64_t) override {
    return Error();
  }
  absl::StatusOr<std::unique_ptr<PinnedHost>> PinHost(uint8_t*, int64_t,
                                                      bool) override {
    return Error();
  }
  absl::StatusOr<std::unique_ptr<ExportedDeviceBuffer>> AllocateExported(
      int, int64_t) override {
    return Error();
  }
  CopyEngine* Engine(int) override { return nullptr; }
  int GpuOf(const std::string&) const override { return -1; }
  absl::StatusOr<std::string> NewFabricId() override { return Error(); }
  absl::StatusOr<std::unique_ptr<Channel>> JoinFabric(int, const std::string&,
                                                      int, int64_t,
                                                      absl::Time) override {
    return Error();
  }

 private:
  absl::Status Error() const {
    return absl::FailedPreconditionError(
        absl::StrCat("GPU memory cannot be registered with this ferryd: ",
                     reason_));
  }

  const std::string reason_;
};

}  // namespace

std::unique_ptr<DeviceMemory> UnavailableDeviceMemory(std::string reason) {
  return std::make_unique<Unavailable>(std::move(reason));
}

}  // namespace ferry
