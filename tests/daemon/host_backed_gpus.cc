#include "tests/daemon/host_backed_gpus.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "core/geometry.h"
#include "tests/support/eventually.h"
#include "transport/local/local_copy_engine.h"
#include "transport/tcp/tcp_channel.h"

namespace ferry {
namespace testing {
namespace {

constexpr size_t kHandleBytes = 64;
const char* const kUuids[2] = {"GPU-fake-0", "GPU-fake-1"};

// Copies with a host engine and counts the bytes, as GPU `gpu`'s engine.
class CountingEngine final : public CopyEngine {
 public:
  CountingEngine(std::atomic<int64_t>* bytes, GpuCounters* counters)
      : host_(CreateLocalCopyEngine(1)), bytes_(bytes), counters_(counters) {}
  std::string name() const override { return "host-backed gpu"; }
  absl::Status Run(const std::vector<LocalCopy>& copies) override {
    const int now = ++counters_->copies_at_once;
    int max = counters_->max_copies_at_once.load();
    while (now > max && !counters_->max_copies_at_once.compare_exchange_weak(
                            max, now)) {
    }
    // The meeting (GpuCounters::copies_to_meet), at most a second: whether
    // it happened is for the test to read in max_copies_at_once.
    testing::Eventually(
        [this] {
          const int meet = counters_->copies_to_meet.load();
          return counters_->copies_at_once.load() >= meet ||
                 counters_->max_copies_at_once.load() >= meet;
        },
        absl::Seconds(1), absl::Milliseconds(1));
    absl::Status s = RunCounted(copies);
    --counters_->copies_at_once;
    return s;
  }

 private:
  absl::Status RunCounted(const std::vector<LocalCopy>& copies) {
    int64_t total = 0;
    for (const LocalCopy& c : copies) {
      int64_t units = 1;
      for (int64_t e : c.extent) units *= e;
      total += units * c.unit_bytes;
    }
    absl::Status s = host_->Run(copies);
    if (s.ok()) bytes_->fetch_add(total);
    return s;
  }

  std::unique_ptr<CopyEngine> host_;
  std::atomic<int64_t>* const bytes_;
  GpuCounters* const counters_;
};

class Gpus;

// Where rank 1 of a fake fabric listens, by communicator id.
class Rendezvous {
 public:
  static Rendezvous& Get() {
    static Rendezvous* r = new Rendezvous();
    return *r;
  }
  void Publish(const std::string& id, int port) {
    absl::MutexLock lock(&mu_);
    ports_[id] = port;
  }
  absl::StatusOr<int> Await(const std::string& id, absl::Time deadline) {
    absl::MutexLock lock(&mu_);
    auto published = [this, &id] { return ports_.count(id) > 0; };
    if (!mu_.AwaitWithDeadline(absl::Condition(&published), deadline)) {
      return absl::DeadlineExceededError("fake fabric: rank 1 never joined");
    }
    return ports_[id];
  }

 private:
  absl::Mutex mu_;
  std::map<std::string, int> ports_;
};

// One reference to an opened allocation.
class Region final : public DeviceRegion {
 public:
  Region(Gpus* owner, std::string handle, uint8_t* data, int gpu)
      : owner_(owner), handle_(std::move(handle)), data_(data), gpu_(gpu) {}
  ~Region() override;
  uint8_t* data() const override { return data_; }
  int gpu() const override { return gpu_; }

 private:
  Gpus* const owner_;
  const std::string handle_;
  uint8_t* const data_;
  const int gpu_;
};

class Pin final : public PinnedHost {
 public:
  explicit Pin(GpuCounters* c) : c_(c) {}
  ~Pin() override { c_->unpins.fetch_add(1); }

 private:
  GpuCounters* const c_;
};

// "GPU memory" the daemon allocated: a shared memory object whose name is
// the handle, as for the clients' fake regions.
class Exported final : public ExportedDeviceBuffer {
 public:
  Exported(SharedMemoryRegion memory, int gpu, GpuCounters* c)
      : memory_(std::move(memory)), gpu_(gpu), c_(c) {
    handle_ = memory_.name();
    handle_.resize(kHandleBytes, '\0');
    c_->allocations.fetch_add(1);
  }
  ~Exported() override { c_->frees.fetch_add(1); }
  uint8_t* data() const override { return memory_.data(); }
  int gpu() const override { return gpu_; }
  const std::string& ipc_handle() const override { return handle_; }

 private:
  SharedMemoryRegion memory_;
  const int gpu_;
  GpuCounters* const c_;
  std::string handle_;
};

class Gpus final : public DeviceMemory {
 public:
  explicit Gpus(GpuCounters* c) : c_(c) {
    for (int g = 0; g < 2; ++g) {
      engines_.push_back(std::make_unique<CountingEngine>(&c->bytes_by_gpu[g], c));
    }
  }

  absl::Status Available() const override { return absl::OkStatus(); }
  std::vector<GpuInfo> Devices() const override {
    std::vector<GpuInfo> out;
    for (int g = 0; g < 2; ++g) {
      GpuInfo info;
      info.ordinal = g;
      info.uuid = kUuids[g];
      info.name = "host-backed test GPU";
      out.push_back(std::move(info));
    }
    return out;
  }

  absl::StatusOr<std::unique_ptr<DeviceRegion>> Map(
      const IpcRegion& region, int64_t size_bytes) override {
    int gpu = -1;
    for (int g = 0; g < 2; ++g) {
      if (region.gpu_uuid == kUuids[g]) gpu = g;
    }
    if (gpu < 0) {
      return absl::FailedPreconditionError("that GPU is not one this ferryd sees");
    }
    const std::string& handle = region.ipc_handle;
    absl::MutexLock lock(&mu_);
    auto it = open_.find(handle);
    if (it == open_.end()) {
      const std::string name = handle.substr(0, handle.find('\0'));
      absl::StatusOr<SharedMemoryRegion> opened = SharedMemoryRegion::Open(
          name, region.allocation_offset_bytes + size_bytes);
      if (!opened.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "cannot open the CUDA IPC handle: ", opened.status().message()));
      }
      it = open_.emplace(handle, Open{*std::move(opened), 0}).first;
      c_->opens.fetch_add(1);
    }
    ++it->second.references;
    return std::unique_ptr<DeviceRegion>(new Region(
        this, handle, it->second.memory.data() + region.allocation_offset_bytes,
        gpu));
  }

  absl::StatusOr<std::unique_ptr<PinnedHost>> PinHost(uint8_t*, int64_t,
                                                      bool read_only) override {
    if (c_->pin_budget.load() == 0) {
      return absl::ResourceExhaustedError("pinning refused (test)");
    }
    if (c_->pin_budget.load() > 0) c_->pin_budget.fetch_sub(1);
    c_->pins.fetch_add(1);
    if (read_only) c_->read_only_pins.fetch_add(1);
    return std::unique_ptr<PinnedHost>(new Pin(c_));
  }

  absl::StatusOr<std::unique_ptr<ExportedDeviceBuffer>> AllocateExported(
      int gpu, int64_t bytes) override {
    if (gpu < 0 || gpu >= 2) return absl::InvalidArgumentError("no such GPU");
    if (c_->allocation_budget.load() == 0) {
      return absl::ResourceExhaustedError("out of GPU memory (test)");
    }
    if (c_->allocation_budget.load() > 0) c_->allocation_budget.fetch_sub(1);
    absl::StatusOr<SharedMemoryRegion> memory = SharedMemoryRegion::Create(
        absl::StrCat("fake-gpu", gpu, "-staging"), std::max<int64_t>(bytes, 1));
    if (!memory.ok()) return memory.status();
    return std::unique_ptr<ExportedDeviceBuffer>(
        new Exported(*std::move(memory), gpu, c_));
  }

  CopyEngine* Engine(int gpu) override {
    return gpu >= 0 && gpu < 2 ? engines_[gpu].get() : nullptr;
  }

  int GpuOf(const std::string& uuid) const override {
    if (uuid.empty()) return 0;
    for (int g = 0; g < 2; ++g) {
      if (uuid == kUuids[g]) return g;
    }
    return -1;
  }

  absl::StatusOr<std::string> NewFabricId() override {
    static std::atomic<int64_t> next{1};
    std::string id = absl::StrCat("fake-fabric-", next.fetch_add(1));
    id.resize(128, '\0');
    return id;
  }

  absl::StatusOr<std::unique_ptr<Channel>> JoinFabric(
      int gpu, const std::string& id, int rank, int64_t,
      absl::Time deadline) override {
    if (gpu < 0 || gpu > 1) return absl::InvalidArgumentError("no such GPU");
    Rendezvous& r = Rendezvous::Get();
    TcpChannelOptions options;
    options.connection_token = id.substr(0, id.find('\0'));
    absl::StatusOr<std::unique_ptr<Channel>> channel;
    if (rank == 1) {
      absl::StatusOr<std::unique_ptr<TcpListener>> listener =
          TcpListener::Listen("127.0.0.1", 0, options);
      if (!listener.ok()) return listener.status();
      r.Publish(id, (*listener)->port());
      channel = (*listener)->Accept(deadline);
    } else {
      absl::StatusOr<int> port = r.Await(id, deadline);
      if (!port.ok()) return port.status();
      channel = ConnectTcpChannel("127.0.0.1", *port, deadline, options);
    }
    if (channel.ok()) c_->fabric_joins.fetch_add(1);
    return channel;
  }

  void Release(const std::string& handle) {
    absl::MutexLock lock(&mu_);
    auto it = open_.find(handle);
    if (it != open_.end() && --it->second.references == 0) {
      open_.erase(it);
      c_->closes.fetch_add(1);
    }
  }

 private:
  struct Open {
    SharedMemoryRegion memory;
    int64_t references = 0;
  };
  GpuCounters* const c_;
  std::vector<std::unique_ptr<CopyEngine>> engines_;
  absl::Mutex mu_;
  std::map<std::string, Open> open_;
};

Region::~Region() { owner_->Release(handle_); }

}  // namespace

v1::MemoryRegion FakeGpuRegion(uint32_t id, const SharedMemoryRegion& memory,
                               const std::string& uuid) {
  v1::MemoryRegion r;
  r.set_region_id(id);
  r.set_size_bytes(memory.size());
  std::string handle = memory.name();
  handle.resize(kHandleBytes, '\0');
  r.mutable_cuda_ipc()->set_ipc_handle(handle);
  r.mutable_cuda_ipc()->mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
  r.mutable_cuda_ipc()->mutable_device()->set_cuda_uuid(uuid);
  return r;
}

std::unique_ptr<DeviceMemory> HostBackedGpus(GpuCounters* counters) {
  return std::make_unique<Gpus>(counters);
}

}  // namespace testing
}  // namespace ferry
