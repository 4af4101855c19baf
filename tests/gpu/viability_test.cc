// Runs on every machine with the CUDA toolkit, GPU or not: the GPU
// backends probe, say "not here" with a reason, and never crash; NCCL
// answers its version without a GPU.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "cuda/device.h"
#include "cuda/ipc/cuda_ipc_copy_engine.h"
#include "cuda/ipc/ipc_memory_cache.h"
#include "cuda/kernels/box_copier.h"
#include "cuda/nccl/nccl_channel.h"
#include "cuda/nccl/nccl_communicator.h"

namespace ferry {
namespace {

TEST_CASE("IsViable says why there is no GPU, or that there is one") {
  const absl::Status s = gpu::IsViable();
  const gpu::DeviceProbe probe = gpu::ProbeDevices();
  std::printf("IsViable: %s (driver %d, runtime %d, %d devices)\n",
              s.ToString().c_str(), probe.driver_version,
              probe.runtime_version, probe.device_count);
  CHECK(gpu::IsViable() == s);  // cached, stable
  if (s.ok()) {
    CHECK(probe.device_count > 0);
    absl::StatusOr<std::string> d = gpu::DescribeDevice(0);
    REQUIRE(d.ok());
    std::printf("device 0: %s\n", d->c_str());
    return;
  }
  CHECK(gpu::IsNotViable(s));
  CHECK(s.message().find("no GPU") != std::string::npos);
  CHECK(s.message().find("cudaGetDeviceCount") != std::string::npos);
  CHECK(probe.device_count == 0);
  CHECK(!gpu::IsNotViable(absl::UnavailableError("a plain error")));
}

// Both machine kinds assert here: without a GPU every factory refuses with
// NotViable; with one, every factory gets past the probe (it works, or
// fails for its own argument, never "not here").
TEST_CASE("every factory answers NotViable without a GPU, and gets past the "
          "probe with one") {
  if (gpu::IsViable().ok()) {
    const int count = gpu::ProbeDevices().device_count;
    REQUIRE(count > 0);
    absl::Status s = gpu::UseDevice(0);
    INFO(s.ToString());
    CHECK(s.ok());
    absl::StatusOr<std::string> uuid = gpu::DeviceUuid(0);
    INFO(uuid.status().ToString());
    REQUIRE(uuid.ok());
    CHECK(uuid->rfind("GPU-", 0) == 0);
    CHECK(uuid->size() == 4 + 32 + 4);  // 8-4-4-4-12 hex digits
    // An ordinal past the last is the caller's mistake, not "no GPU".
    s = gpu::UseDevice(count);
    INFO(s.ToString());
    CHECK(absl::IsInvalidArgument(s));
    CHECK(!gpu::IsNotViable(s));
    absl::StatusOr<std::unique_ptr<CopyEngine>> engine =
        CreateCudaIpcCopyEngine();
    INFO(engine.status().ToString());
    CHECK(engine.ok());
    absl::StatusOr<std::unique_ptr<gpu::BoxCopier>> copier =
        gpu::BoxCopier::Create(0);
    INFO(copier.status().ToString());
    CHECK(copier.ok());
    // Past the probe, each factory checks its own arguments.
    const absl::Status channel = CreateNcclChannel(nullptr, {}).status();
    INFO(channel.ToString());
    CHECK(absl::IsInvalidArgument(channel));
    const absl::Status exported = gpu::ExportCudaIpcHandle(nullptr).status();
    INFO(exported.ToString());
    CHECK(!exported.ok());
    CHECK(!gpu::IsNotViable(exported));
    gpu::NcclCommunicatorOptions options;
    options.unique_id.assign(gpu::kNcclUniqueIdBytes, '\0');
    options.device = count;
    const absl::Status comm =
        gpu::NcclCommunicator::Create(options, absl::Now() + absl::Seconds(1))
            .status();
    INFO(comm.ToString());
    CHECK(absl::IsInvalidArgument(comm));  // the ordinal, before any NCCL call
    return;
  }
  CHECK(gpu::IsNotViable(gpu::UseDevice(0)));
  CHECK(gpu::IsNotViable(gpu::DescribeDevice(0).status()));
  CHECK(gpu::IsNotViable(CreateCudaIpcCopyEngine().status()));
  CHECK(gpu::IsNotViable(gpu::BoxCopier::Create(0).status()));
  CHECK(gpu::IsNotViable(CreateNcclChannel(nullptr, {}).status()));
  CHECK(gpu::IsNotViable(gpu::ExportCudaIpcHandle(nullptr).status()));
  gpu::NcclCommunicatorOptions options;
  options.unique_id.assign(gpu::kNcclUniqueIdBytes, '\0');
  CHECK(gpu::IsNotViable(
      gpu::NcclCommunicator::Create(options, absl::Now() + absl::Seconds(1))
          .status()));
  // The CUDA mapper refuses too; the cache then caches nothing.
  gpu::IpcMemoryCache cache(gpu::CreateCudaIpcMapper());
  CHECK(gpu::IsNotViable(
      cache.Register(0, std::string(gpu::kCudaIpcHandleBytes, 'h')).status()));
  CHECK(cache.size() == 0);
}

TEST_CASE("ncclGetVersion reports NCCL 2.28") {
  absl::StatusOr<int> code = gpu::NcclVersionCode();
  INFO(code.status().ToString());
  REQUIRE(code.ok());
  const std::string version = gpu::NcclVersionString(*code);
  std::printf("NCCL %s (%d)\n", version.c_str(), *code);
  CHECK(version.rfind("2.28.", 0) == 0);
}

TEST_CASE("malformed communicator options are INVALID_ARGUMENT before any GPU call") {
  gpu::NcclCommunicatorOptions options;
  options.unique_id = "short";
  CHECK(absl::IsInvalidArgument(
      gpu::NcclCommunicator::Create(options, absl::Now()).status()));
  options.unique_id.assign(gpu::kNcclUniqueIdBytes, '\0');
  options.rank = 2;
  options.world_size = 2;
  CHECK(absl::IsInvalidArgument(
      gpu::NcclCommunicator::Create(options, absl::Now()).status()));
}

}  // namespace
}  // namespace ferry
