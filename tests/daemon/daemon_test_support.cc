#include "tests/daemon/daemon_test_support.h"

#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "catch2/catch.hpp"
#include "tests/daemon/host_backed_gpus.h"
#include "tests/daemon/test_certs.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

constexpr int64_t kRegionBytes = 4096;

v1::Box MakeBox(const std::vector<int64_t>& offset,
                const std::vector<int64_t>& extent) {
  v1::Box b;
  for (int64_t o : offset) b.add_offset(o);
  for (int64_t e : extent) b.add_extent(e);
  return b;
}

int64_t Volume(const std::vector<int64_t>& dims) {
  int64_t v = 1;
  for (int64_t d : dims) v *= d;
  return v;
}

v1::MemoryRegion ShmRegion(uint32_t id, const SharedMemoryRegion& memory) {
  v1::MemoryRegion r;
  r.set_region_id(id);
  r.set_size_bytes(memory.size());
  r.mutable_shared_memory()->set_shm_name(memory.name());
  return r;
}

}  // namespace

std::string MakeTempDir() {
  char tmpl[] = "/tmp/ferryd-test-XXXXXX";
  char* dir = ::mkdtemp(tmpl);
  REQUIRE(dir != nullptr);
  return dir;
}

TestDaemon::TestDaemon(DaemonOptions o, std::unique_ptr<DeviceMemory> devices)
    : dir(MakeTempDir()), options(o) {
  options.socket_path = dir + "/run/ferryd.sock";
  if (options.listen_address.empty()) options.listen_address = "127.0.0.1:0";
  if (!options.tls.any()) options.tls = TestTls(options.node);
  absl::StatusOr<std::unique_ptr<Server>> s =
      Server::Start(options, std::move(devices));
  INFO(s.status().ToString());
  REQUIRE(s.ok());
  server = *std::move(s);
  channel = Connect();
  registry = v1::Registry::NewStub(channel);
  versions = v1::Versions::NewStub(channel);
  inspection = v1::Inspection::NewStub(channel);
  lifecycle = v1::Lifecycle::NewStub(channel);
}

TestDaemon::~TestDaemon() {
  server->Shutdown();
  std::string cmd = "rm -rf '" + dir + "'";
  (void)::system(cmd.c_str());
}

namespace {
DaemonOptions NodeOptions(const std::string& node,
                          const std::string& coordinator,
                          const DaemonOptions& base) {
  DaemonOptions o = base;
  o.node = node;
  o.coordinator_address = coordinator;
  return o;
}
}  // namespace

TwoNodes::TwoNodes(std::unique_ptr<DeviceMemory> a_devices,
                   std::unique_ptr<DeviceMemory> b_devices,
                   const DaemonOptions& base,
                   std::optional<DaemonOptions> member_base)
    : a(NodeOptions("node-a", "", base), std::move(a_devices)),
      b(NodeOptions("node-b",
                    "127.0.0.1:" + std::to_string(a.server->tcp_port()),
                    member_base.value_or(base)),
        std::move(b_devices)) {
  // The member has joined once the coordinator lists it and the member
  // itself knows (it forwards registrations only then: the JoinCoordinator
  // answer may still be on its way when the coordinator already lists it).
  const bool joined = Eventually(
      [&] {
        grpc::ClientContext ctx, ctx_b;
        v1::GetHealthResponse h, hb;
        return a.inspection->GetHealth(&ctx, v1::GetHealthRequest(), &h).ok() &&
               h.peers_size() == 1 &&
               b.inspection->GetHealth(&ctx_b, v1::GetHealthRequest(), &hb)
                   .ok() &&
               hb.peers_size() == 1 && hb.peers(0).reachable();
      },
      absl::Seconds(5), absl::Milliseconds(10));
  if (!joined) FAIL("node-b did not join node-a");
}

Nodes::Nodes(int members, const DaemonOptions& base)
    : coordinator(std::make_unique<TestDaemon>(
          NodeOptions("node-a", "", base))) {
  const std::string address =
      "127.0.0.1:" + std::to_string(coordinator->server->tcp_port());
  for (int m = 0; m < members; ++m) {
    const std::string node = std::string("node-") + static_cast<char>('b' + m);
    this->members.push_back(
        std::make_unique<TestDaemon>(NodeOptions(node, address, base)));
  }
  // Joined: the coordinator lists every member, and each member knows it
  // (as TwoNodes waits).
  const bool joined = Eventually(
      [&] {
        grpc::ClientContext ctx;
        v1::GetHealthResponse h;
        if (!coordinator->inspection
                 ->GetHealth(&ctx, v1::GetHealthRequest(), &h)
                 .ok() ||
            h.peers_size() != members) {
          return false;
        }
        for (const auto& m : this->members) {
          grpc::ClientContext ctx_m;
          v1::GetHealthResponse hm;
          if (!m->inspection->GetHealth(&ctx_m, v1::GetHealthRequest(), &hm)
                   .ok() ||
              hm.peers_size() < 1 || !hm.peers(0).reachable()) {
            return false;
          }
        }
        return true;
      },
      absl::Seconds(10), absl::Milliseconds(10));
  if (!joined) FAIL("the members did not join node-a");
}

std::shared_ptr<grpc::Channel> TestDaemon::Connect() const {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(64 << 20);
  return grpc::CreateCustomChannel("unix:" + options.socket_path,
                                   grpc::InsecureChannelCredentials(), args);
}

const std::vector<TestParam>& TestModel() {
  static const std::vector<TestParam> model = {
      {"model.layers.0.self_attn.q_proj.weight", {8, 8}},
      {"model.layers.0.self_attn.k_proj.weight", {8, 8}},
      {"model.layers.0.self_attn.v_proj.weight", {8, 8}},
      {"model.layers.0.mlp.down_proj.weight", {8, 16}},
      {"model.norm.weight", {8}},
      {"lm_head.weight", {16, 8}},
  };
  return model;
}

namespace {
std::function<float(int, int64_t, int64_t)>& ValueFunction() {
  static auto* fn = new std::function<float(int, int64_t, int64_t)>();
  return *fn;
}
}  // namespace

void SetValueFunction(std::function<float(int, int64_t, int64_t)> fn) {
  ValueFunction() = std::move(fn);
}

float ValueAt(int param, int64_t flat, int64_t version) {
  if (ValueFunction()) return ValueFunction()(param, flat, version);
  return static_cast<float>(version * 100000 + param * 1000 + flat);
}

// ---------------------------------------------------------------------------

TrainerRank::TrainerRank(int r, const std::string& s) : rank(r), stream(s) {
  int64_t at = 0;
  auto add = [&](int param, std::vector<int64_t> offset,
                 std::vector<int64_t> extent) {
    slices.push_back({param, offset, extent, at});
    at += Volume(extent) * 4;
  };
  for (int p = 0; p < 3; ++p) add(p, {4 * r, 0}, {4, 8});  // column shards
  add(3, {0, 8 * r}, {8, 8});                              // row shard
  add(4, {0}, {8});                                        // replica
  add(5, {8 * r, 0}, {8, 8});                              // vocab rows
  auto m = SharedMemoryRegion::Create(absl::StrCat("trainer-", r),
                                      kRegionBytes);
  REQUIRE(m.ok());
  memory = std::make_unique<SharedMemoryRegion>(*std::move(m));
}

void TrainerRank::Fill(int64_t version) {
  float* base = reinterpret_cast<float*>(memory->data());
  for (const Slice& s : slices) {
    const std::vector<int64_t>& shape = TestModel()[s.param].shape;
    float* out = base + s.byte_offset / 4;
    if (shape.size() == 1) {
      for (int64_t i = 0; i < s.extent[0]; ++i) {
        *out++ = ValueAt(s.param, s.offset[0] + i, version);
      }
      continue;
    }
    for (int64_t i = 0; i < s.extent[0]; ++i) {
      for (int64_t j = 0; j < s.extent[1]; ++j) {
        *out++ = ValueAt(s.param,
                         (s.offset[0] + i) * shape[1] + s.offset[1] + j,
                         version);
      }
    }
  }
}

v1::RegisterSourceRequest TrainerRank::Registration() const {
  v1::RegisterSourceRequest req;
  v1::SourceRegistration* s = req.mutable_source();
  s->set_stream(stream);
  s->set_rank(rank);
  s->set_world_size(2);
  if (gpu_uuid.empty()) {
    s->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    *s->add_regions() = ShmRegion(0, *memory);
  } else {
    s->mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
    s->mutable_device()->set_cuda_uuid(gpu_uuid);
    *s->add_regions() = FakeGpuRegion(0, *memory, gpu_uuid);
  }
  for (const TestParam& p : TestModel()) {
    v1::ParameterSpec* ps = s->add_parameters();
    ps->set_name(p.name);
    ps->set_dtype(v1::DTYPE_F32);
    for (int64_t d : p.shape) ps->add_shape(d);
  }
  for (const Slice& sl : slices) {
    v1::Piece* piece = s->add_pieces();
    piece->set_parameter(TestModel()[sl.param].name);
    *piece->mutable_box() = MakeBox(sl.offset, sl.extent);
    piece->set_region_id(0);
    piece->set_byte_offset(sl.byte_offset);
  }
  return req;
}

// ---------------------------------------------------------------------------

namespace {
// Engine rank buffer layout (floats) at TP t, with r = 8 / t rows of each
// of q, k, v: qkv [3r, 8] at 0, down [8, 16 / t] after it, norm [8], then
// lm_head ([16 / t, 8] direct, or [16, 8] for its loader). At TP4: qkv
// [6, 8] at 0, down [8, 4] at 48, norm [8] at 80, lm_head at 88.
struct EngineOffsets {
  explicit EngineOffsets(int tp)
      : rows(8 / tp),
        qkv(0),
        down(3 * rows * 8),
        norm(down + 8 * (16 / tp)),
        lm_head(norm + 8) {}
  int64_t rows, qkv, down, norm, lm_head;
};
}  // namespace

EngineRank::EngineRank(const std::string& inst, int r, const std::string& s)
    : instance(inst), tp_rank(r), stream(s) {
  auto m = SharedMemoryRegion::Create(absl::StrCat("engine-", inst, "-", r),
                                      kRegionBytes);
  REQUIRE(m.ok());
  memory = std::make_unique<SharedMemoryRegion>(*std::move(m));
}

EngineRank::~EngineRank() { Stop(); }

v1::RegisterDestinationRequest EngineRank::Registration() const {
  v1::RegisterDestinationRequest req;
  v1::DestinationRegistration* d = req.mutable_destination();
  d->set_instance_id(instance);
  d->set_stream(stream);
  d->set_tp_rank(tp_rank);
  d->set_tp_size(tp_size);
  const EngineOffsets at(tp_size);
  if (gpu_uuid.empty()) {
    d->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    *d->add_regions() = ShmRegion(0, *memory);
  } else {
    d->mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
    d->mutable_device()->set_cuda_uuid(gpu_uuid);
    *d->add_regions() = FakeGpuRegion(0, *memory, gpu_uuid);
  }
  if (device_staging) d->set_staging(v1::STAGING_PLACEMENT_DEVICE);
  auto param = [&](const std::string& name, std::vector<int64_t> shape,
                   int64_t float_offset, v1::LoaderKind loader,
                   int shard_dim) {
    v1::EngineParameter* p = d->mutable_engine_table()->add_parameters();
    p->set_name(name);
    p->set_dtype(v1::DTYPE_F32);
    for (int64_t x : shape) p->add_local_shape(x);
    p->set_region_id(0);
    p->set_byte_offset(float_offset * 4);
    p->set_loader(loader);
    p->set_loader_tp_size(tp_size);
    p->set_shard_dim(shard_dim);
    return p;
  };
  v1::EngineParameter* qkv =
      param("model.layers.0.self_attn.qkv_proj.weight", {3 * at.rows, 8},
            at.qkv, v1::LOADER_KIND_FUSED, 0);
  for (int p = 0; p < 3; ++p) {
    qkv->add_fused_parts()->set_checkpoint_name(TestModel()[p].name);
  }
  param(TestModel()[3].name, {8, 16 / tp_size}, at.down, v1::LOADER_KIND_ROW,
        1);
  param(TestModel()[4].name, {8}, at.norm, v1::LOADER_KIND_REPLICATED, 0);
  if (lm_head_direct) {
    param(TestModel()[5].name, {16 / tp_size, 8}, at.lm_head,
          v1::LOADER_KIND_VOCAB_PARALLEL, 0);
  } else {
    param(TestModel()[5].name, {16, 8}, at.lm_head, v1::LOADER_KIND_CUSTOM, 0);
  }
  return req;
}

void EngineRank::Run(v1::Versions::Stub* versions) {
  context_ = std::make_unique<grpc::ClientContext>();
  // No Catch2 assertion on this thread (Catch2 v2 asserts on the test's
  // thread only): it records the events in `log`, and a staging region it
  // cannot map shows as a wrong lm_head in Check(), on the test's thread.
  thread_ = std::thread([this, versions] {
    v1::SubscribeRequest req;
    *req.mutable_handle() = handle;
    auto reader = versions->Subscribe(context_.get(), req);
    v1::UpdateEvent e;
    while (reader->Read(&e)) {
      {
        std::lock_guard<std::mutex> lock(mu);
        log.push_back(absl::StrCat(v1::UpdateEventKind_Name(e.kind()), " ",
                                   e.version()));
        if (e.kind() == v1::UPDATE_EVENT_KIND_COMMIT) committed = e.version();
      }
      if (e.kind() == v1::UPDATE_EVENT_KIND_APPLY) {
        // The engine's own loader: map staging once, read fallback tensors.
        std::map<uint32_t, std::unique_ptr<SharedMemoryRegion>> kept;
        std::vector<std::string> kinds;
        for (const v1::MemoryRegion& r : e.apply().staging_regions()) {
          kinds.push_back(r.has_cuda_ipc()
                              ? "cuda:" + r.cuda_ipc().device().cuda_uuid()
                              : "host");
          auto it = staging_.find(r.region_id());
          if (it != staging_.end()) {
            kept[r.region_id()] = std::move(it->second);
            continue;
          }
          // Device staging from host-backed GPUs: the handle is the name
          // of the shared memory that stands for the GPU allocation.
          const std::string& handle = r.cuda_ipc().ipc_handle();
          const std::string name =
              r.has_cuda_ipc() ? handle.substr(0, handle.find('\0'))
                               : r.shared_memory().shm_name();
          auto m = SharedMemoryRegion::Open(name, r.size_bytes());
          if (m.ok()) {
            kept[r.region_id()] =
                std::make_unique<SharedMemoryRegion>(*std::move(m));
          }
        }
        staging_ = std::move(kept);  // regions not listed are unmapped
        std::lock_guard<std::mutex> lock(mu);
        staging_kinds = std::move(kinds);
        last_fallbacks.clear();
        for (const v1::FallbackTensor& t : e.apply().fallback_tensors()) {
          auto it = staging_.find(t.region_id());
          if (it == staging_.end()) continue;
          last_fallbacks.push_back(t.parameter());
          const float* full = reinterpret_cast<const float*>(
              it->second->data() + t.byte_offset());
          if (t.parameter() == TestModel()[5].name && !lm_head_direct) {
            loaded_lm_head.assign(full, full + t.size_bytes() / 4);
          } else {
            Load(t.parameter(), full, t.size_bytes() / 4);
          }
        }
      }
      std::string lifecycle_error;
      if (e.kind() == v1::UPDATE_EVENT_KIND_OFFLOAD) {
        std::lock_guard<std::mutex> lock(mu);
        memory.reset();  // unmapped; the owner unlinks its name
        offloaded = true;
      } else if (e.kind() == v1::UPDATE_EVENT_KIND_ONLOAD &&
                 registry != nullptr &&
                 !(e.version() == hang_version.load() &&
                   static_cast<int>(e.kind()) == hang_kind.load())) {
        auto m = SharedMemoryRegion::Create(
            absl::StrCat("engine-", instance, "-", tp_rank, "-on",
                         onloads.fetch_add(1)),
            kRegionBytes);
        if (!m.ok()) {
          lifecycle_error = std::string(m.status().message());
        } else {
          auto fresh = std::make_unique<SharedMemoryRegion>(*std::move(m));
          v1::UpdateRegionsRequest u;
          *u.mutable_handle() = handle;
          *u.add_regions() = ShmRegion(0, *fresh);
          v1::UpdateRegionsResponse ur;
          grpc::ClientContext uc;
          const grpc::Status us = registry->UpdateRegions(&uc, u, &ur);
          if (!us.ok()) {
            lifecycle_error = us.error_message();
          } else {
            std::lock_guard<std::mutex> lock(mu);
            memory = std::move(fresh);
            offloaded = false;
          }
        }
      }
      if (e.ack_timeout_ms() == 0) continue;
      if (e.version() == hang_version.load() &&
          static_cast<int>(e.kind()) == hang_kind.load()) {
        continue;  // a stuck rank: never acks
      }
      v1::AckRequest ack;
      *ack.mutable_handle() = handle;
      ack.set_event_id(e.event_id());
      ack.set_version(e.version());
      ack.set_kind(e.kind());
      ack.set_status(v1::ACK_STATUS_OK);
      if (e.version() == fail_version.load() &&
          static_cast<int>(e.kind()) == fail_kind.load()) {
        ack.set_status(v1::ACK_STATUS_FAILED);
        ack.set_error_message("load_weights raised KeyError 'lm_head.weight'");
      }
      if (!lifecycle_error.empty()) {
        ack.set_status(v1::ACK_STATUS_FAILED);
        ack.set_error_message(lifecycle_error);
      }
      v1::AckResponse resp;
      grpc::ClientContext ctx;
      versions->Ack(&ctx, ack, &resp);
    }
    reader->Finish();
  });
}

void EngineRank::Load(const std::string& name, const float* full,
                      int64_t floats) {
  const EngineOffsets at(tp_size);
  float* live = reinterpret_cast<float*>(memory->data());
  int param = -1;
  for (size_t p = 0; p < TestModel().size(); ++p) {
    if (TestModel()[p].name == name) param = static_cast<int>(p);
  }
  if (param < 0) return;
  if (param <= 2 && floats == 64) {  // q, k, v [8, 8]: its rows, fused
    std::memcpy(live + at.qkv + param * at.rows * 8,
                full + at.rows * tp_rank * 8, at.rows * 8 * sizeof(float));
  } else if (param == 3 && floats == 128) {  // down [8, 16]: its columns
    const int64_t cols = 16 / tp_size;
    for (int64_t i = 0; i < 8; ++i) {
      std::memcpy(live + at.down + i * cols, full + i * 16 + cols * tp_rank,
                  cols * sizeof(float));
    }
  } else if (param == 4 && floats == 8) {  // norm, replicated
    std::memcpy(live + at.norm, full, 8 * sizeof(float));
  } else if (param == 5 && floats == 128) {  // lm_head: its vocab rows
    const int64_t n = 8 * (16 / tp_size);
    std::memcpy(live + at.lm_head, full + n * tp_rank, n * sizeof(float));
  }
}

void EngineRank::Stop() {
  if (context_ != nullptr) context_->TryCancel();
  if (thread_.joinable()) thread_.join();
}

std::string EngineRank::Check(int64_t v) const {
  std::lock_guard<std::mutex> lock(mu);
  if (memory == nullptr) {
    return absl::StrCat(instance, " tp rank ", tp_rank,
                        ": holds no memory (offloaded)");
  }
  const float* live = reinterpret_cast<const float*>(memory->data());
  auto expect = [&](const char* what, int64_t at, float want) -> std::string {
    if (live[at] == want) return "";
    return absl::StrCat(instance, " tp rank ", tp_rank, ": ", what,
                        " float ", at, " is ", live[at], ", want ", want);
  };
  const EngineOffsets at(tp_size);
  std::string bad;
  for (int64_t i = 0; i < 3 * at.rows && bad.empty(); ++i) {
    const int part = i / at.rows;
    const int64_t row = at.rows * tp_rank + i % at.rows;
    for (int64_t c = 0; c < 8 && bad.empty(); ++c) {
      bad = expect("qkv_proj", at.qkv + i * 8 + c,
                   ValueAt(part, row * 8 + c, v));
    }
  }
  const int64_t cols = 16 / tp_size;
  for (int64_t i = 0; i < 8 && bad.empty(); ++i) {
    for (int64_t j = 0; j < cols && bad.empty(); ++j) {
      bad = expect("down_proj", at.down + i * cols + j,
                   ValueAt(3, i * 16 + cols * tp_rank + j, v));
    }
  }
  for (int64_t i = 0; i < 8 && bad.empty(); ++i) {
    bad = expect("norm", at.norm + i, ValueAt(4, i, v));
  }
  if (lm_head_direct) {  // its rows of the vocab, live
    const int64_t floats = 8 * (16 / tp_size);
    for (int64_t i = 0; i < floats && bad.empty(); ++i) {
      bad = expect("lm_head", at.lm_head + i,
                   ValueAt(5, floats * tp_rank + i, v));
    }
    return bad;
  }
  if (!bad.empty()) return bad;
  if (loaded_lm_head.size() != 128) {
    return absl::StrCat(instance, " tp rank ", tp_rank, ": lm_head from "
                        "staging has ", loaded_lm_head.size(), " floats");
  }
  for (int64_t i = 0; i < 128; ++i) {
    if (loaded_lm_head[i] != ValueAt(5, i, v)) {
      return absl::StrCat(instance, " tp rank ", tp_rank, ": lm_head float ",
                          i, " is ", loaded_lm_head[i], ", want ",
                          ValueAt(5, i, v));
    }
  }
  return "";
}

void RegisterSource(TestDaemon& d, TrainerRank& t) {
  grpc::ClientContext ctx;
  v1::RegisterSourceResponse resp;
  grpc::Status s = d.registry->RegisterSource(&ctx, t.Registration(), &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  t.handle = resp.handle();
}

void RegisterDestination(TestDaemon& d, EngineRank& e) {
  grpc::ClientContext ctx;
  v1::RegisterDestinationResponse resp;
  grpc::Status s =
      d.registry->RegisterDestination(&ctx, e.Registration(), &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  e.handle = resp.handle();
}

std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> RunVersion(
    TestDaemon& d, std::vector<TrainerRank*> trainers, int64_t version) {
  std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> out(
      trainers.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < trainers.size(); ++i) {
    threads.emplace_back([&, i] {
      TrainerRank& t = *trainers[i];
      t.Fill(version);
      v1::BeginVersionRequest begin;
      *begin.mutable_handle() = t.handle;
      begin.set_version(version);
      v1::BeginVersionResponse began;
      grpc::ClientContext c1;
      grpc::Status s = d.versions->BeginVersion(&c1, begin, &began);
      if (!s.ok()) {
        out[i].first = s;
        return;
      }
      v1::CommitVersionRequest commit;
      *commit.mutable_handle() = t.handle;
      commit.set_version(version);
      grpc::ClientContext c2;
      out[i].first = d.versions->CommitVersion(&c2, commit, &out[i].second);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

void ExpectVersionCommits(TestDaemon& d, std::vector<TrainerRank*> trainers,
                          const std::vector<EngineRank*>& engines, int64_t v,
                          int instances) {
  for (auto& [status, resp] : RunVersion(d, std::move(trainers), v)) {
    INFO("version " << v << ": " << status.error_message());
    REQUIRE(status.ok());
    REQUIRE(resp.instances_size() == instances);
    for (const auto& s : resp.instances()) {
      INFO(s.DebugString());
      CHECK(s.state() == v1::INSTANCE_STATE_COMMITTED);
      CHECK(s.committed_version() == v);
      CHECK_FALSE(s.dirty());
    }
  }
  // COMMIT is sent after the outcome is known: wait for each stream's.
  for (EngineRank* e : engines) {
    const bool told = Eventually(
        [&] {
          std::lock_guard<std::mutex> lock(e->mu);
          return e->committed == v;
        },
        absl::Seconds(1), absl::Milliseconds(5));
    std::lock_guard<std::mutex> lock(e->mu);
    INFO(e->instance << " tp rank " << e->tp_rank << " was told COMMIT "
                     << e->committed << ", want " << v);
    CHECK(told);
  }
  for (EngineRank* e : engines) {
    INFO("version " << v << ": " << e->instance << " tp rank " << e->tp_rank);
    CHECK(e->Check(v) == "");
  }
}

void Shrink(const SharedMemoryRegion& region) {
  const int fd = ::shm_open(region.name().c_str(), O_RDWR, 0);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, 0) == 0);
  ::close(fd);
}

v1::GetProgressResponse ProgressOf(TestDaemon& d, const std::string& stream,
                                   int64_t version) {
  grpc::ClientContext ctx;
  v1::GetProgressRequest req;
  req.set_stream(stream);
  req.set_version(version);
  v1::GetProgressResponse progress;
  if (!d.inspection->GetProgress(&ctx, req, &progress).ok()) return {};
  return progress;
}

v1::InstanceState StateOf(TestDaemon& d, const std::string& stream,
                          int64_t version, const std::string& id) {
  const v1::GetProgressResponse progress = ProgressOf(d, stream, version);
  for (const v1::InstanceProgress& i : progress.instances()) {
    if (i.status().instance_id() == id) return i.status().state();
  }
  return v1::INSTANCE_STATE_UNSPECIFIED;
}

bool AckHeld(TestDaemon& d, const EngineRank& rank, v1::UpdateEventKind kind,
             int64_t version) {
  for (uint64_t id = 1; id <= 8; ++id) {
    grpc::ClientContext ctx;
    v1::AckRequest ack;
    *ack.mutable_handle() = rank.handle;
    ack.set_event_id(id);
    ack.set_version(version);
    ack.set_kind(kind);
    ack.set_status(v1::ACK_STATUS_OK);
    v1::AckResponse resp;
    if (d.versions->Ack(&ctx, ack, &resp).ok()) return true;
  }
  return false;
}

void ExpectAllCommitted(
    const std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>>&
        outcome) {
  for (const auto& [status, resp] : outcome) {
    INFO(status.error_message());
    REQUIRE(status.ok());
    for (const v1::InstanceStatus& s : resp.instances()) {
      INFO(s.DebugString());
      CHECK(s.state() == v1::INSTANCE_STATE_COMMITTED);
    }
  }
}

void ExpectAnswers(TestDaemon& d) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetHealthResponse h;
  grpc::Status s = d.inspection->GetHealth(&ctx, {}, &h);
  INFO(s.error_message());
  CHECK(s.ok());
}

}  // namespace testing
}  // namespace ferry
