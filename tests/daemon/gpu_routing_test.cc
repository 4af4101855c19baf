// ferryd's GPU wiring without a GPU: ranks register CUDA IPC regions, the
// daemon maps each allocation once, copies every box with the engine of
// the right GPU (host-backed here, tests/daemon/host_backed_gpus.h), pins
// fallback staging and host memory that GPU kernels read, and refuses what
// it cannot pin before any byte moves.
// Bytes are checked against the trainer's values (the oracle), not the
// plan. The node's own DeviceMemory (no GPU here) refuses CUDA regions.
#include <chrono>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"
#include "tests/daemon/host_backed_gpus.h"

namespace ferry {
namespace testing {
namespace {

// Per engine rank: qkv 192 + down_proj 128 + norm 32 bytes land in live
// buffers, lm_head's 512 in staging (the test model's TP4 instance).
constexpr int64_t kDirectBytes = 192 + 128 + 32;
constexpr int64_t kFallbackBytes = 512;

struct GpuFleet {
  // trainer_gpu: "" (host memory) or a GPU; engine ranks 0,1 on GPU 0 and
  // 2,3 on GPU 1.
  GpuFleet(GpuCounters* counters, const std::string& trainer_gpu)
      : counters(*counters), daemon(DaemonOptions(), HostBackedGpus(counters)) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      trainers.back()->gpu_uuid = trainer_gpu;
    }
    for (int r = 0; r < 4; ++r) {
      engines.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
      engines.back()->gpu_uuid = r < 2 ? "GPU-fake-0" : "GPU-fake-1";
    }
    for (auto& t : trainers) RegisterSource(daemon, *t);
    for (auto& e : engines) RegisterDestination(daemon, *e);
    for (auto& e : engines) e->Run(daemon.versions.get());
  }
  ~GpuFleet() {
    for (auto& e : engines) e->Stop();
  }
  std::vector<TrainerRank*> sources() {
    return {trainers[0].get(), trainers[1].get()};
  }

  GpuCounters& counters;  // outlives the daemon, which reports into it
  TestDaemon daemon;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

}  // namespace

TEST_CASE("GPU ranks: each box is copied by the engine of its GPU",
          "[daemon][gpu]") {
  GpuCounters counters;
  {
    GpuFleet fleet(&counters, "GPU-fake-0");
    // One open per registered allocation (2 trainers + 4 engine ranks).
    CHECK(counters.opens == 6);
    for (int64_t v = 1; v <= 2; ++v) {
      for (auto& [status, resp] : RunVersion(fleet.daemon, fleet.sources(), v)) {
        INFO(status.error_message());
        REQUIRE(status.ok());
        REQUIRE(resp.instances_size() == 1);
        INFO(resp.instances(0).DebugString());
        CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_COMMITTED);
      }
      for (auto& e : fleet.engines) {
        INFO("version " << v << " rank " << e->tp_rank);
        CHECK(e->Check(v) == "");
      }
    }
    // Live bytes of ranks 2,3 by GPU 1's engine; everything else (ranks
    // 0,1, and all staging, which the source's GPU writes) by GPU 0's.
    CHECK(counters.bytes_by_gpu[1] == 2 * (2 * kDirectBytes));
    CHECK(counters.bytes_by_gpu[0] == 2 * (2 * kDirectBytes + 4 * kFallbackBytes));
    // Each rank's one staging slot (lm_head) is pinned once, not per version.
    CHECK(counters.pins == 4);
    CHECK(counters.opens == 6);

    grpc::ClientContext ctx;
    v1::GetHealthResponse health;
    REQUIRE(fleet.daemon.inspection
                ->GetHealth(&ctx, v1::GetHealthRequest(), &health)
                .ok());
    CHECK(health.devices_size() == 2);
    CHECK(health.gpu_unavailable_reason().empty());
  }
  // Every mapping closed and every pin released once the daemon is gone.
  CHECK(counters.closes == 6);
  CHECK(counters.unpins == 4);
}

TEST_CASE("host trainer memory feeds GPU engines through pinned memory",
          "[daemon][gpu]") {
  GpuCounters counters;
  GpuFleet fleet(&counters, "");  // trainers in host shared memory
  SECTION("each trainer region is pinned once and read by the GPU kernels") {
    for (int64_t v = 1; v <= 2; ++v) {
      for (auto& [status, resp] : RunVersion(fleet.daemon, fleet.sources(), v)) {
        INFO(status.error_message());
        REQUIRE(status.ok());
        REQUIRE(resp.instances_size() == 1);
        INFO(resp.instances(0).DebugString());
        CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_COMMITTED);
      }
      for (auto& e : fleet.engines) {
        INFO("version " << v << " rank " << e->tp_rank);
        CHECK(e->Check(v) == "");
      }
    }
    // Live bytes by the engine of each rank's GPU; staging (host to pinned
    // host) by the CPU.
    CHECK(counters.bytes_by_gpu[0] == 2 * (2 * kDirectBytes));
    CHECK(counters.bytes_by_gpu[1] == 2 * (2 * kDirectBytes));
    CHECK(counters.pins == 4 + 2);  // staging slots + the two trainer regions
  }
  SECTION("memory that cannot be pinned aborts the instance clean") {
    counters.pin_budget = 4;  // the staging slots, not the trainer regions
    for (auto& [status, resp] : RunVersion(fleet.daemon, fleet.sources(), 1)) {
      INFO(status.error_message());
      REQUIRE(status.ok());
      REQUIRE(resp.instances_size() == 1);
      const v1::InstanceStatus& s = resp.instances(0);
      INFO(s.DebugString());
      CHECK(s.state() == v1::INSTANCE_STATE_ABORTED);
      CHECK_FALSE(s.dirty());  // the live buffers still hold version 0
      CHECK(s.abort_reason().find("source policy rank") != std::string::npos);
      CHECK(s.abort_reason().find("host memory") != std::string::npos);
      CHECK(s.abort_reason().find("cannot be pinned") != std::string::npos);
    }
    CHECK(counters.bytes_by_gpu[0] == 0);
    CHECK(counters.bytes_by_gpu[1] == 0);
  }
}

namespace {

// A coordinator (node-a) and a member (node-b) in this process, each with
// its own host-backed GPUs.
struct TwoNodes {
  TwoNodes()
      : a(Options("node-a", ""), HostBackedGpus(&a_gpus)),
        b(Options("node-b",
                  "127.0.0.1:" + std::to_string(a.server->tcp_port())),
          HostBackedGpus(&b_gpus)) {
    // The member has joined once the coordinator lists it.
    for (int i = 0; i < 500; ++i) {
      grpc::ClientContext ctx;
      v1::GetHealthResponse h;
      if (a.inspection->GetHealth(&ctx, v1::GetHealthRequest(), &h).ok() &&
          h.peers_size() == 1) {
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    FAIL("node-b did not join node-a");
  }
  static DaemonOptions Options(const std::string& node,
                               const std::string& coordinator) {
    DaemonOptions o;
    o.node = node;
    o.coordinator_address = coordinator;
    return o;
  }
  GpuCounters a_gpus, b_gpus;
  TestDaemon a, b;
};

}  // namespace

TEST_CASE("on a member node, GPU boxes go through that node's GPU engines",
          "[daemon][gpu][nodes]") {
  TwoNodes nodes;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    trainers.back()->gpu_uuid = "GPU-fake-0";
    RegisterSource(nodes.b, *trainers.back());
  }
  for (int r = 0; r < 4; ++r) {
    engines.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
    engines.back()->gpu_uuid = r < 2 ? "GPU-fake-0" : "GPU-fake-1";
    RegisterDestination(nodes.b, *engines.back());
  }
  for (auto& e : engines) e->Run(nodes.b.versions.get());
  for (auto& [status, resp] :
       RunVersion(nodes.b, {trainers[0].get(), trainers[1].get()}, 1)) {
    INFO(status.error_message());
    REQUIRE(status.ok());
    REQUIRE(resp.instances_size() == 1);
    INFO(resp.instances(0).DebugString());
    CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_COMMITTED);
  }
  for (auto& e : engines) {
    INFO("rank " << e->tp_rank);
    CHECK(e->Check(1) == "");
  }
  // node-b's engines did it all, as on one node; node-a's none.
  CHECK(nodes.b_gpus.bytes_by_gpu[1] == 2 * kDirectBytes);
  CHECK(nodes.b_gpus.bytes_by_gpu[0] == 2 * kDirectBytes + 4 * kFallbackBytes);
  CHECK(nodes.a_gpus.bytes_by_gpu[0] + nodes.a_gpus.bytes_by_gpu[1] == 0);
  CHECK(nodes.b_gpus.pins == 4);  // the GPU ranks' staging on node-b
  for (auto& e : engines) e->Stop();
}

TEST_CASE("GPU memory between nodes travels over the (fake) NCCL fabric",
          "[daemon][gpu][nodes]") {
  TwoNodes nodes;
  // Trainers on node-a, on GPU 0 or in host memory; the instance on
  // node-b's GPU 1.
  const bool gpu_trainers = GENERATE(true, false);
  INFO((gpu_trainers ? "GPU" : "host") << " trainers");
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    trainers.back()->gpu_uuid = gpu_trainers ? "GPU-fake-0" : "";
    RegisterSource(nodes.a, *trainers.back());
  }
  for (int r = 0; r < 4; ++r) {
    engines.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
    engines.back()->gpu_uuid = "GPU-fake-1";
    RegisterDestination(nodes.b, *engines.back());
  }
  for (auto& e : engines) e->Run(nodes.b.versions.get());
  for (int64_t v = 1; v <= 2; ++v) {
    for (auto& [status, resp] :
         RunVersion(nodes.a, {trainers[0].get(), trainers[1].get()}, v)) {
      INFO(status.error_message());
      REQUIRE(status.ok());
      REQUIRE(resp.instances_size() == 1);
      INFO(resp.instances(0).DebugString());
      CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_COMMITTED);
    }
    for (auto& e : engines) {
      INFO("version " << v << " rank " << e->tp_rank);
      CHECK(e->Check(v) == "");
    }
  }
  // One communicator, joined once by each daemon and kept for version 2.
  CHECK(nodes.a_gpus.fabric_joins == 1);
  CHECK(nodes.b_gpus.fabric_joins == 1);
  // node-b pinned its GPU ranks' staging; node-a its host trainer regions.
  CHECK(nodes.b_gpus.pins == 4);
  CHECK(nodes.a_gpus.pins == (gpu_trainers ? 0 : 2));
  for (auto& e : engines) e->Stop();
}

TEST_CASE("a host rank's staging cannot take GPU memory from another node",
          "[daemon][gpu][nodes]") {
  TwoNodes nodes;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    trainers.back()->gpu_uuid = "GPU-fake-0";
    RegisterSource(nodes.a, *trainers.back());
  }
  for (int r = 0; r < 4; ++r) {
    engines.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
    RegisterDestination(nodes.b, *engines.back());  // host memory
  }
  for (auto& e : engines) e->Run(nodes.b.versions.get());
  for (auto& [status, resp] :
       RunVersion(nodes.a, {trainers[0].get(), trainers[1].get()}, 1)) {
    INFO(status.error_message());
    REQUIRE(status.ok());
    REQUIRE(resp.instances_size() == 1);
    const v1::InstanceStatus& s = resp.instances(0);
    INFO(s.DebugString());
    CHECK(s.state() == v1::INSTANCE_STATE_ABORTED);
    CHECK_FALSE(s.dirty());
    CHECK(s.abort_reason().find("instance r0 tp rank") != std::string::npos);
    CHECK(s.abort_reason().find("staging") != std::string::npos);
  }
  for (auto& e : engines) e->Stop();
}

TEST_CASE("malformed CUDA IPC regions are INVALID_ARGUMENT or "
          "FAILED_PRECONDITION naming the rank and region", "[daemon][gpu]") {
  GpuCounters counters;
  TestDaemon daemon(DaemonOptions(), HostBackedGpus(&counters));
  TrainerRank t(0, "policy");
  t.gpu_uuid = "GPU-fake-0";

  auto attempt = [&](void (*mutate)(v1::MemoryRegion*)) {
    v1::RegisterSourceRequest req = t.Registration();
    mutate(req.mutable_source()->mutable_regions(0));
    grpc::ClientContext ctx;
    v1::RegisterSourceResponse resp;
    return daemon.registry->RegisterSource(&ctx, req, &resp);
  };
  SECTION("a handle that is not 64 bytes") {
    grpc::Status s = attempt([](v1::MemoryRegion* r) {
      r->mutable_cuda_ipc()->set_ipc_handle("abc");
    });
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find("source policy rank 0: region 0") !=
          std::string::npos);
    CHECK(s.error_message().find("ipc_handle is 3 bytes") != std::string::npos);
  }
  SECTION("no device") {
    grpc::Status s = attempt(
        [](v1::MemoryRegion* r) { r->mutable_cuda_ipc()->clear_device(); });
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find("cuda_uuid") != std::string::npos);
  }
  SECTION("a negative allocation offset") {
    grpc::Status s = attempt([](v1::MemoryRegion* r) {
      r->mutable_cuda_ipc()->set_allocation_offset_bytes(-4096);
    });
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find("allocation_offset_bytes -4096") !=
          std::string::npos);
  }
  SECTION("a GPU this daemon does not see") {
    grpc::Status s = attempt([](v1::MemoryRegion* r) {
      r->mutable_cuda_ipc()->mutable_device()->set_cuda_uuid("GPU-elsewhere");
    });
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(s.error_message().find("region 0 (GPU GPU-elsewhere)") !=
          std::string::npos);
  }
  CHECK(counters.opens == counters.closes);
}

TEST_CASE("a ferryd without usable GPUs refuses CUDA regions and says why",
          "[daemon][gpu]") {
  TestDaemon daemon;  // the node's own GPUs: none on a machine without one
  grpc::ClientContext hctx;
  v1::GetHealthResponse health;
  REQUIRE(daemon.inspection->GetHealth(&hctx, v1::GetHealthRequest(), &health)
              .ok());
  if (health.devices_size() > 0) {
    WARN("this machine has a GPU; tests/gpu covers the real path");
    return;
  }
  CHECK_FALSE(health.gpu_unavailable_reason().empty());
  TrainerRank t(0, "policy");
  t.gpu_uuid = "GPU-00000000-0000-0000-0000-000000000000";
  grpc::ClientContext ctx;
  v1::RegisterSourceResponse resp;
  grpc::Status s = daemon.registry->RegisterSource(&ctx, t.Registration(), &resp);
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("source policy rank 0: region 0") !=
        std::string::npos);
  CHECK(s.error_message().find(health.gpu_unavailable_reason()) !=
        std::string::npos);
}

}  // namespace testing
}  // namespace ferry
