// ferryd's GPU wiring without a GPU: ranks register CUDA IPC regions, the
// daemon maps each allocation once, copies every box with the engine of
// the right GPU (host-backed here, tests/daemon/host_backed_gpus.h), pins
// fallback staging and host memory that GPU kernels read, and refuses what
// it cannot pin before any byte moves.
// Bytes are checked against the trainer's values (the oracle), not the
// plan. The node's own DeviceMemory lists its GPUs (or says why there are
// none) and refuses regions on a GPU it does not have, on either machine.
#include <chrono>
#include <cstdio>
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

// A TP2 trainer registered with `sources_at` and a TP4 instance "r0"
// registered with `engines_at` (the same daemon, or another node's).
// Trainer ranks are on `trainer_gpu` ("": host memory); engine rank r on
// engine_gpu(r) ("": host memory).
struct Ranks {
  Ranks(TestDaemon& sources_at, const std::string& trainer_gpu,
        TestDaemon& engines_at, std::string (*engine_gpu)(int),
        bool device_staging = false)
      : trainer_daemon(sources_at) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      trainers.back()->gpu_uuid = trainer_gpu;
      RegisterSource(sources_at, *trainers.back());
    }
    for (int r = 0; r < 4; ++r) {
      engines.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
      engines.back()->gpu_uuid = engine_gpu(r);
      engines.back()->device_staging = device_staging;
      RegisterDestination(engines_at, *engines.back());
    }
    for (auto& e : engines) e->Run(engines_at.versions.get());
  }
  ~Ranks() { Stop(); }
  void Stop() {
    for (auto& e : engines) e->Stop();
  }

  // Version v commits on the instance, and every engine rank holds its
  // bytes (checked against the trainer's values, not the plan).
  void ExpectCommits(int64_t v) {
    std::vector<EngineRank*> ranks;
    for (auto& e : engines) ranks.push_back(e.get());
    ExpectVersionCommits(trainer_daemon, {trainers[0].get(), trainers[1].get()},
                         ranks, v, 1);
  }

  // Version v aborts the instance clean (the live buffers still hold the
  // previous version), with a reason that contains every one of `words`.
  void ExpectAbortsClean(int64_t v, const std::vector<std::string>& words) {
    for (auto& [status, resp] :
         RunVersion(trainer_daemon, {trainers[0].get(), trainers[1].get()}, v)) {
      INFO(status.error_message());
      REQUIRE(status.ok());
      REQUIRE(resp.instances_size() == 1);
      const v1::InstanceStatus& s = resp.instances(0);
      INFO(s.DebugString());
      CHECK(s.state() == v1::INSTANCE_STATE_ABORTED);
      CHECK_FALSE(s.dirty());
      for (const std::string& w : words) {
        INFO("reason should say: " << w);
        CHECK(s.abort_reason().find(w) != std::string::npos);
      }
    }
  }

  TestDaemon& trainer_daemon;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

std::string TwoGpus(int r) { return r < 2 ? "GPU-fake-0" : "GPU-fake-1"; }
std::string Gpu1(int) { return "GPU-fake-1"; }
std::string HostMemory(int) { return ""; }

// Two in-process nodes (daemon_test_support.h), each with host-backed GPUs.
struct GpuNodes {
  GpuCounters a_gpus, b_gpus;  // outlive the daemons
  TwoNodes nodes{HostBackedGpus(&a_gpus), HostBackedGpus(&b_gpus)};
};

}  // namespace

TEST_CASE("GPU ranks: each box is copied by the engine of its GPU",
          "[daemon][gpu]") {
  GpuCounters counters;
  {
    TestDaemon daemon(DaemonOptions(), HostBackedGpus(&counters));
    Ranks ranks(daemon, "GPU-fake-0", daemon, TwoGpus);
    // One open per registered allocation (2 trainers + 4 engine ranks).
    CHECK(counters.opens == 6);
    ranks.ExpectCommits(1);
    ranks.ExpectCommits(2);
    // Live bytes of ranks 2,3 by GPU 1's engine; everything else (ranks
    // 0,1, and all staging, which the source's GPU writes) by GPU 0's.
    CHECK(counters.bytes_by_gpu[1] == 2 * (2 * kDirectBytes));
    CHECK(counters.bytes_by_gpu[0] == 2 * (2 * kDirectBytes + 4 * kFallbackBytes));
    // Each rank's one staging slot (lm_head) is pinned once, not per version.
    CHECK(counters.pins == 4);
    CHECK(counters.opens == 6);

    grpc::ClientContext ctx;
    v1::GetHealthResponse health;
    REQUIRE(daemon.inspection->GetHealth(&ctx, v1::GetHealthRequest(), &health)
                .ok());
    CHECK(health.devices_size() == 2);
    CHECK(health.gpu_unavailable_reason().empty());
    ranks.Stop();
  }
  // Every mapping closed and every pin released once the daemon is gone.
  CHECK(counters.closes == 6);
  CHECK(counters.unpins == 4);
}

TEST_CASE("GPU ranks that ask for device staging get their fallback "
          "tensors in GPU memory on their own GPU",
          "[daemon][gpu]") {
  GpuCounters counters;
  {
    DaemonOptions options;
    SECTION("device staging") {}
    SECTION("--nodevice_staging: pinned host staging") {
      options.device_staging = false;
    }
    TestDaemon daemon(options, HostBackedGpus(&counters));
    Ranks ranks(daemon, "GPU-fake-0", daemon, TwoGpus,
                /*device_staging=*/true);
    // lm_head, read by each rank's loader from staging, is checked against
    // the trainer's values with every live byte.
    ranks.ExpectCommits(1);
    ranks.ExpectCommits(2);
    for (int r = 0; r < 4; ++r) {
      INFO("engine rank " << r);
      std::lock_guard<std::mutex> lock(ranks.engines[r]->mu);
      const std::vector<std::string> want = {
          options.device_staging ? "cuda:" + TwoGpus(r) : "host"};
      CHECK(ranks.engines[r]->staging_kinds == want);
    }
    if (options.device_staging) {
      // One allocation per rank, kept across versions, none pinned; each
      // GPU's engine writes its own ranks' staging.
      CHECK(counters.allocations == 4);
      CHECK(counters.pins == 0);
      CHECK(counters.bytes_by_gpu[1] ==
            2 * (2 * kDirectBytes + 2 * kFallbackBytes));
      CHECK(counters.bytes_by_gpu[0] ==
            2 * (2 * kDirectBytes + 2 * kFallbackBytes));
    } else {
      CHECK(counters.allocations == 0);
      CHECK(counters.pins == 4);
    }
    ranks.Stop();
  }
  CHECK(counters.frees == counters.allocations);
}

TEST_CASE("device staging that cannot be allocated aborts the version "
          "clean, naming the parameter and the way out",
          "[daemon][gpu]") {
  GpuCounters counters;
  TestDaemon daemon(DaemonOptions(), HostBackedGpus(&counters));
  counters.allocation_budget = 0;
  Ranks ranks(daemon, "GPU-fake-0", daemon, TwoGpus, /*device_staging=*/true);
  ranks.ExpectAbortsClean(
      1, {"lm_head", "cannot be allocated", "--nodevice_staging"});
  counters.allocation_budget = -1;
  ranks.ExpectCommits(2);
}

TEST_CASE("a host rank cannot ask for device staging, nor any rank for a "
          "placement that does not exist",
          "[daemon][gpu]") {
  GpuCounters counters;
  TestDaemon daemon(DaemonOptions(), HostBackedGpus(&counters));
  EngineRank engine("r0", 0, "policy");
  engine.device_staging = true;  // its memory is host memory
  grpc::ClientContext ctx;
  v1::RegisterDestinationResponse resp;
  const grpc::Status s = daemon.registry->RegisterDestination(
      &ctx, engine.Registration(), &resp);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("instance r0 tp rank 0") != std::string::npos);
  CHECK(s.error_message().find("staging DEVICE") != std::string::npos);

  // Garbage: a placement the enum does not have, from a GPU rank.
  EngineRank gpu_engine("r1", 0, "policy");
  gpu_engine.gpu_uuid = "GPU-fake-0";
  v1::RegisterDestinationRequest garbage = gpu_engine.Registration();
  garbage.mutable_destination()->set_staging(
      static_cast<v1::StagingPlacement>(77));
  grpc::ClientContext ctx2;
  const grpc::Status g =
      daemon.registry->RegisterDestination(&ctx2, garbage, &resp);
  INFO(g.error_message());
  CHECK(g.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(g.error_message().find("instance r1 tp rank 0: staging 77 is not a "
                               "placement") != std::string::npos);
}

TEST_CASE("two instances transfer at once, each on a transfer worker; "
          "--transfer_workers=1 runs them one after the other",
          "[daemon][gpu]") {
  // Instance r0 (TP4) on GPU 0, r1 (TP2) on GPU 1, every byte direct (no
  // staging), so each instance's copies run on its own GPU's engine only.
  // Their layouts differ, so neither relays from the other (replicas of
  // one layout on one node relay, in turn: relay_test.cc). Each copy waits
  // up to a second for a second copy to be in progress.
  for (const int workers : {8, 1}) {
    INFO("--transfer_workers=" << workers);
    GpuCounters counters;
    counters.copies_to_meet = 2;
    DaemonOptions options;
    options.transfer_workers = workers;
    TestDaemon daemon(options, HostBackedGpus(&counters));
    std::vector<std::unique_ptr<TrainerRank>> trainers;
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      trainers.back()->gpu_uuid = "GPU-fake-0";
      RegisterSource(daemon, *trainers.back());
    }
    std::vector<std::unique_ptr<EngineRank>> engines;
    for (const std::string instance : {"r0", "r1"}) {
      const int tp = instance == "r0" ? 4 : 2;
      for (int r = 0; r < tp; ++r) {
        engines.push_back(std::make_unique<EngineRank>(instance, r, "policy"));
        engines.back()->gpu_uuid =
            instance == "r0" ? "GPU-fake-0" : "GPU-fake-1";
        engines.back()->tp_size = tp;
        engines.back()->lm_head_direct = true;
        RegisterDestination(daemon, *engines.back());
      }
    }
    std::vector<EngineRank*> ranks;
    for (auto& e : engines) {
      e->Run(daemon.versions.get());
      ranks.push_back(e.get());
    }
    ExpectVersionCommits(daemon, {trainers[0].get(), trainers[1].get()},
                         ranks, 1, 2);
    // The bytes are right either way (checked above); what differs is
    // whether r0's and r1's copies were in progress at the same time.
    CHECK(counters.max_copies_at_once == (workers == 1 ? 1 : 2));
    for (auto& e : engines) e->Stop();
  }
}

TEST_CASE("host trainer memory feeds GPU engines through pinned memory",
          "[daemon][gpu]") {
  GpuCounters counters;
  TestDaemon daemon(DaemonOptions(), HostBackedGpus(&counters));
  SECTION("each trainer region is pinned once and read by the GPU kernels") {
    Ranks ranks(daemon, "", daemon, TwoGpus);  // trainers in host memory
    ranks.ExpectCommits(1);
    ranks.ExpectCommits(2);
    // Live bytes by the engine of each rank's GPU; staging (host to pinned
    // host) by the CPU.
    CHECK(counters.bytes_by_gpu[0] == 2 * (2 * kDirectBytes));
    CHECK(counters.bytes_by_gpu[1] == 2 * (2 * kDirectBytes));
    CHECK(counters.pins == 4 + 2);  // staging slots + the two trainer regions
  }
  SECTION("memory that cannot be pinned aborts the instance clean") {
    Ranks ranks(daemon, "", daemon, TwoGpus);
    counters.pin_budget = 4;  // the staging slots, not the trainer regions
    ranks.ExpectAbortsClean(
        1, {"source policy rank", "host memory", "cannot be pinned"});
    CHECK(counters.bytes_by_gpu[0] == 0);
    CHECK(counters.bytes_by_gpu[1] == 0);
  }
}

TEST_CASE("on a member node, GPU boxes go through that node's GPU engines",
          "[daemon][gpu][nodes]") {
  GpuNodes g;
  Ranks ranks(g.nodes.b, "GPU-fake-0", g.nodes.b, TwoGpus);
  ranks.ExpectCommits(1);
  // node-b's engines did it all, as on one node; node-a's none.
  CHECK(g.b_gpus.bytes_by_gpu[1] == 2 * kDirectBytes);
  CHECK(g.b_gpus.bytes_by_gpu[0] == 2 * kDirectBytes + 4 * kFallbackBytes);
  CHECK(g.a_gpus.bytes_by_gpu[0] + g.a_gpus.bytes_by_gpu[1] == 0);
  CHECK(g.b_gpus.pins == 4);  // the GPU ranks' staging on node-b
}

TEST_CASE("GPU memory between nodes travels over the (fake) NCCL fabric",
          "[daemon][gpu][nodes]") {
  GpuNodes g;
  // Trainers on node-a, on GPU 0 or in host memory; the instance on
  // node-b's GPU 1.
  const bool gpu_trainers = GENERATE(true, false);
  INFO((gpu_trainers ? "GPU" : "host") << " trainers");
  Ranks ranks(g.nodes.a, gpu_trainers ? "GPU-fake-0" : "", g.nodes.b, Gpu1);
  ranks.ExpectCommits(1);
  ranks.ExpectCommits(2);
  // One communicator, joined once by each daemon and kept for version 2.
  CHECK(g.a_gpus.fabric_joins == 1);
  CHECK(g.b_gpus.fabric_joins == 1);
  // node-b pinned its GPU ranks' staging; node-a its host trainer regions.
  CHECK(g.b_gpus.pins == 4);
  CHECK(g.a_gpus.pins == (gpu_trainers ? 0 : 2));
}

TEST_CASE("a host rank's staging cannot take GPU memory from another node",
          "[daemon][gpu][nodes]") {
  GpuNodes g;
  Ranks ranks(g.nodes.a, "GPU-fake-0", g.nodes.b, HostMemory);
  ranks.ExpectAbortsClean(1, {"instance r0 tp rank", "staging"});
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

namespace {

// Registers trainer rank 0 with its region on GPU `uuid`; the outcome.
grpc::Status RegisterOnGpu(TestDaemon& daemon, const std::string& uuid) {
  TrainerRank t(0, "policy");
  t.gpu_uuid = uuid;
  grpc::ClientContext ctx;
  v1::RegisterSourceResponse resp;
  return daemon.registry->RegisterSource(&ctx, t.Registration(), &resp);
}

v1::GetHealthResponse Health(TestDaemon& daemon) {
  grpc::ClientContext ctx;
  v1::GetHealthResponse health;
  grpc::Status s =
      daemon.inspection->GetHealth(&ctx, v1::GetHealthRequest(), &health);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return health;
}

constexpr char kNoSuchGpu[] = "GPU-00000000-0000-0000-0000-000000000000";

}  // namespace

TEST_CASE("a ferryd with GPUs turned off refuses CUDA regions and says why",
          "[daemon][gpu]") {
  DaemonOptions options;
  options.use_gpus = false;  // ferryd --gpus=false: the same on every machine
  TestDaemon daemon(options);
  const v1::GetHealthResponse health = Health(daemon);
  CHECK(health.devices_size() == 0);
  CHECK(health.gpu_unavailable_reason().find("disabled") != std::string::npos);
  grpc::Status s = RegisterOnGpu(daemon, kNoSuchGpu);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("source policy rank 0: region 0") !=
        std::string::npos);
  CHECK(s.error_message().find(health.gpu_unavailable_reason()) !=
        std::string::npos);
}

// The node's own DeviceMemory. Without a GPU: no devices, a reason, and
// CUDA regions refused with it. With GPUs: every one listed, no reason,
// and a region on a GPU it does not have refused, naming the ones it has
// (tests/gpu and device_check.sh cover mapping real IPC memory).
TEST_CASE("a ferryd reports its own GPUs, or why it has none, and refuses "
          "regions on GPUs it lacks", "[daemon][gpu]") {
  TestDaemon daemon;
  const v1::GetHealthResponse health = Health(daemon);
  grpc::Status s = RegisterOnGpu(daemon, kNoSuchGpu);
  INFO(health.DebugString());
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("source policy rank 0: region 0 (GPU " +
                               std::string(kNoSuchGpu) + ")") !=
        std::string::npos);
  if (health.devices_size() == 0) {
    std::printf("no GPU here: %s\n", health.gpu_unavailable_reason().c_str());
    CHECK_FALSE(health.gpu_unavailable_reason().empty());
    CHECK(s.error_message().find(health.gpu_unavailable_reason()) !=
          std::string::npos);
    return;
  }
  std::printf("GPUs here: %d\n", health.devices_size());
  CHECK(health.gpu_unavailable_reason().empty());
  for (int i = 0; i < health.devices_size(); ++i) {
    const v1::DeviceInfo& d = health.devices(i);
    CHECK(d.device().kind() == v1::DEVICE_KIND_CUDA);
    CHECK(d.device().cuda_ordinal() == i);
    CHECK(d.device().cuda_uuid().rfind("GPU-", 0) == 0);
    CHECK(d.device().cuda_uuid() != kNoSuchGpu);
    CHECK_FALSE(d.name().empty());
    CHECK(d.memory_bytes() > 0);
    // The refusal names the GPUs this ferryd does see.
    CHECK(s.error_message().find(d.device().cuda_uuid()) != std::string::npos);
  }
  CHECK(s.error_message().find("not one this ferryd sees") != std::string::npos);
}

}  // namespace testing
}  // namespace ferry
