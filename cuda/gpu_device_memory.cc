#include "cuda/gpu_device_memory.h"

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cuda/cuda_status.h"
#include "cuda/device.h"
#include "cuda/ipc/cuda_ipc_copy_engine.h"
#include "cuda/ipc/ipc_memory_cache.h"
#include "cuda/nccl/nccl_channel.h"
#include "cuda/nccl/nccl_communicator.h"
#include "glog/logging.h"

namespace ferry {
namespace gpu {
namespace {

// cuMemGetAddressRange from the driver, reached through the runtime so that
// ferryd does not link libcuda itself. Null when the driver lacks it.
using AddressRangeFn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);

AddressRangeFn LoadAddressRange() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000,
                                       cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    (void)cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<AddressRangeFn>(fn);
}

class GpuRegion final : public DeviceRegion {
 public:
  GpuRegion(IpcMemoryCache* cache, int gpu, std::string handle, uint8_t* data)
      : cache_(cache), gpu_(gpu), handle_(std::move(handle)), data_(data) {}
  ~GpuRegion() override {
    absl::Status s = cache_->Deregister(gpu_, handle_);
    if (!s.ok()) LOG(WARNING) << "closing a CUDA IPC mapping: " << s;
  }
  uint8_t* data() const override { return data_; }
  int gpu() const override { return gpu_; }

 private:
  IpcMemoryCache* const cache_;
  const int gpu_;
  const std::string handle_;
  uint8_t* const data_;
};

class Pinned final : public PinnedHost {
 public:
  explicit Pinned(uint8_t* data) : data_(data) {}
  ~Pinned() override {
    absl::Status s = CudaStatus(cudaHostUnregister(data_), "cudaHostUnregister");
    if (!s.ok()) LOG(WARNING) << s;
  }

 private:
  uint8_t* const data_;
};

// cudaMalloc'd staging exported over CUDA IPC (a GPU rank's fallback
// tensors). cudaFree on the GPU that holds it.
class ExportedBuffer final : public ExportedDeviceBuffer {
 public:
  ExportedBuffer(int gpu, uint8_t* data, std::string handle)
      : gpu_(gpu), data_(data), handle_(std::move(handle)) {}
  ~ExportedBuffer() override {
    absl::Status s = UseDevice(gpu_);
    if (s.ok()) s = CudaStatus(cudaFree(data_), "cudaFree (staging)");
    if (!s.ok()) LOG(WARNING) << s;
  }
  uint8_t* data() const override { return data_; }
  int gpu() const override { return gpu_; }
  const std::string& ipc_handle() const override { return handle_; }

 private:
  const int gpu_;
  uint8_t* const data_;
  const std::string handle_;
};

// An NCCL channel with the communicator it runs on: the channel goes first
// (it may wait for sends in flight), then the communicator is aborted.
class FabricChannel final : public Channel {
 public:
  FabricChannel(std::unique_ptr<Channel> channel,
                std::unique_ptr<NcclCommunicator> comm)
      : comm_(std::move(comm)), channel_(std::move(channel)) {}
  absl::Status Send(const BucketView& bucket, absl::Time deadline) override {
    return channel_->Send(bucket, deadline);
  }
  absl::Status Flush(absl::Time deadline) override {
    return channel_->Flush(deadline);
  }
  absl::Status Receive(const BucketView& bucket, absl::Time deadline) override {
    return channel_->Receive(bucket, deadline);
  }

 private:
  // Destroyed in reverse order: channel_, then comm_.
  std::unique_ptr<NcclCommunicator> comm_;
  std::unique_ptr<Channel> channel_;
};

class GpuDeviceMemory final : public DeviceMemory {
 public:
  GpuDeviceMemory() : cache_(CreateCudaIpcMapper()) {}

  absl::Status Init(const GpuDeviceMemoryOptions& options) {
    fabric_staging_bytes_ = options.fabric_staging_bytes;
    const int count = ProbeDevices().device_count;
    for (int d = 0; d < count; ++d) {
      if (absl::Status s = UseDevice(d); !s.ok()) return s;
      cudaDeviceProp prop;
      FERRY_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&prop, d));
      absl::StatusOr<std::string> uuid = DeviceUuid(d);
      if (!uuid.ok()) return uuid.status();
      GpuInfo info;
      info.ordinal = d;
      info.uuid = *uuid;
      info.name = prop.name;
      info.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
      devices_.push_back(std::move(info));
      int host_pointer = 0;
      FERRY_CUDA_RETURN_IF_ERROR(cudaDeviceGetAttribute(
          &host_pointer, cudaDevAttrCanUseHostPointerForRegisteredMem, d));
      host_pointer_ok_ = host_pointer_ok_ && host_pointer != 0;

      CudaIpcCopyEngineOptions engine;
      engine.device = d;
      engine.timeout = options.copy_timeout;
      absl::StatusOr<std::unique_ptr<CopyEngine>> e =
          CreateCudaIpcCopyEngine(engine);
      if (!e.ok()) return e.status();
      engines_.push_back(*std::move(e));
    }
    // Peer access both ways between every pair that has it (NVLink or PCIe
    // P2P); pairs without it fail their copies with the driver's error.
    for (int a = 0; a < count; ++a) {
      if (absl::Status s = UseDevice(a); !s.ok()) return s;
      for (int b = 0; b < count; ++b) {
        int can = 0;
        if (a == b || cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess ||
            can == 0) {
          continue;
        }
        const cudaError_t e = cudaDeviceEnablePeerAccess(b, 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) {
          LOG(WARNING) << CudaStatus(e, absl::StrCat("peer access ", a, " -> ", b));
        }
        (void)cudaGetLastError();
      }
    }
    address_range_ = LoadAddressRange();
    LOG(INFO) << "GPUs: " << count << " ("
              << absl::StrJoin(devices_, ", ",
                               [](std::string* out, const GpuInfo& i) {
                                 absl::StrAppend(out, i.name, " ", i.uuid);
                               })
              << ")";
    return absl::OkStatus();
  }

  absl::Status Available() const override { return absl::OkStatus(); }
  std::vector<GpuInfo> Devices() const override { return devices_; }

  absl::StatusOr<std::unique_ptr<DeviceRegion>> Map(
      const IpcRegion& region, int64_t size_bytes) override {
    const int gpu = OrdinalOf(region.gpu_uuid);
    if (gpu < 0) {
      std::vector<std::string> seen;
      for (const GpuInfo& i : devices_) {
        seen.push_back(i.uuid);
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "that GPU is not one this ferryd sees (it sees ",
          seen.empty() ? "none" : absl::StrJoin(seen, ", "),
          "); run ferryd with every GPU of the node visible"));
    }
    absl::StatusOr<uint8_t*> base = cache_.Register(gpu, region.ipc_handle);
    if (!base.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cannot open the CUDA IPC handle: ", base.status().message()));
    }
    auto mapped = std::make_unique<GpuRegion>(
        &cache_, gpu, region.ipc_handle,
        *base + region.allocation_offset_bytes);
    if (address_range_ != nullptr) {
      CUdeviceptr start = 0;
      size_t bytes = 0;
      if (address_range_(&start, &bytes,
                         reinterpret_cast<CUdeviceptr>(*base)) != CUDA_SUCCESS) {
        // Not expected for an IPC mapping; the region is then trusted as
        // the client declared it.
        LOG_FIRST_N(WARNING, 1) << "cuMemGetAddressRange failed on a CUDA "
                                   "IPC mapping; region extents unchecked";
        return std::unique_ptr<DeviceRegion>(std::move(mapped));
      }
      const int64_t available =
          static_cast<int64_t>(bytes) -
          (static_cast<int64_t>(reinterpret_cast<CUdeviceptr>(*base)) -
           static_cast<int64_t>(start));
      if (region.allocation_offset_bytes + size_bytes > available) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bytes [", region.allocation_offset_bytes, ", ",
            region.allocation_offset_bytes + size_bytes,
            ") are past the end of the allocation (", available, " bytes)"));
      }
    }
    return std::unique_ptr<DeviceRegion>(std::move(mapped));
  }

  absl::StatusOr<std::unique_ptr<PinnedHost>> PinHost(
      uint8_t* data, int64_t bytes, bool read_only) override {
    if (!host_pointer_ok_) {
      return absl::FailedPreconditionError(
          "these GPUs cannot use host pointers of registered memory "
          "(cudaDevAttrCanUseHostPointerForRegisteredMem)");
    }
    if (devices_.empty()) return absl::FailedPreconditionError("no GPU");
    if (absl::Status s = UseDevice(0); !s.ok()) return s;
    // Read-only mappings (a source's region) need cudaHostRegisterReadOnly,
    // else the driver's attempt to pin them for writing fails.
    FERRY_CUDA_RETURN_IF_ERROR(cudaHostRegister(
        data, static_cast<size_t>(bytes),
        cudaHostRegisterPortable | cudaHostRegisterMapped |
            (read_only ? cudaHostRegisterReadOnly : 0)));
    return std::unique_ptr<PinnedHost>(new Pinned(data));
  }

  absl::StatusOr<std::unique_ptr<ExportedDeviceBuffer>> AllocateExported(
      int gpu, int64_t bytes) override {
    if (gpu < 0 || gpu >= static_cast<int>(devices_.size()) || bytes < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("AllocateExported: no GPU ", gpu, " or ", bytes,
                       " bytes"));
    }
    if (absl::Status s = UseDevice(gpu); !s.ok()) return s;
    void* data = nullptr;
    // cudaMalloc, not the stream-ordered pool: cudaIpcGetMemHandle needs
    // memory from cudaMalloc.
    const cudaError_t e = cudaMalloc(&data, static_cast<size_t>(
                                                std::max<int64_t>(bytes, 1)));
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      const absl::Status why = CudaStatus(e, "cudaMalloc");
      return absl::ResourceExhaustedError(
          absl::StrCat(bytes, " bytes on GPU ", gpu, " (", devices_[gpu].uuid,
                       "): ", why.message()));
    }
    cudaIpcMemHandle_t handle;
    const cudaError_t h = cudaIpcGetMemHandle(&handle, data);
    if (h != cudaSuccess) {
      (void)cudaGetLastError();
      (void)cudaFree(data);
      return CudaStatus(h, "cudaIpcGetMemHandle (staging)");
    }
    return std::unique_ptr<ExportedDeviceBuffer>(new ExportedBuffer(
        gpu, static_cast<uint8_t*>(data),
        std::string(reinterpret_cast<const char*>(&handle), sizeof(handle))));
  }

  int GpuOf(const std::string& uuid) const override {
    if (uuid.empty()) return devices_.empty() ? -1 : 0;
    return OrdinalOf(uuid);
  }

  absl::StatusOr<std::string> NewFabricId() override {
    return NewNcclUniqueId();
  }

  absl::StatusOr<std::unique_ptr<Channel>> JoinFabric(
      int gpu, const std::string& id, int rank, int64_t epoch,
      absl::Time deadline) override {
    if (gpu < 0 || gpu >= static_cast<int>(devices_.size()) || rank < 0 ||
        rank > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("JoinFabric: no GPU ", gpu, " or rank ", rank));
    }
    NcclCommunicatorOptions options;
    options.device = gpu;
    options.rank = rank;
    options.world_size = 2;
    options.epoch = epoch;
    options.unique_id = id;
    absl::StatusOr<std::unique_ptr<NcclCommunicator>> comm =
        NcclCommunicator::Create(options, deadline);
    if (!comm.ok()) return comm.status();
    NcclChannelOptions channel_options;
    channel_options.peer = 1 - rank;
    channel_options.staging_bytes = fabric_staging_bytes_;
    absl::StatusOr<std::unique_ptr<Channel>> channel =
        CreateNcclChannel(comm->get(), channel_options);
    if (!channel.ok()) return channel.status();
    return std::unique_ptr<Channel>(
        new FabricChannel(*std::move(channel), *std::move(comm)));
  }

  CopyEngine* Engine(int gpu) override {
    return gpu >= 0 && gpu < static_cast<int>(engines_.size())
               ? engines_[gpu].get()
               : nullptr;
  }

 private:
  int OrdinalOf(const std::string& uuid) const {
    for (size_t d = 0; d < devices_.size(); ++d) {
      if (devices_[d].uuid == uuid) return static_cast<int>(d);
    }
    return -1;
  }

  IpcMemoryCache cache_;
  std::vector<GpuInfo> devices_;
  std::vector<std::unique_ptr<CopyEngine>> engines_;
  bool host_pointer_ok_ = true;
  int64_t fabric_staging_bytes_ = 0;
  AddressRangeFn address_range_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceMemory>> CreateGpuDeviceMemory(
    const GpuDeviceMemoryOptions& options) {
  if (absl::Status s = IsViable(); !s.ok()) return s;
  auto memory = std::make_unique<GpuDeviceMemory>();
  if (absl::Status s = memory->Init(options); !s.ok()) return s;
  return std::unique_ptr<DeviceMemory>(std::move(memory));
}

}  // namespace gpu
}  // namespace ferry
