// FP8 in flight between two daemons (issue 40; docs/api.md, "Quantized in
// flight"), in process with real gRPC, TCP channels and shared memory: the
// TP 2 f32 trainer on the coordinator node-a, an FP8 engine rank on the
// member node-b. The coordinator quantizes and sends FP8 bytes and scales
// to the member. Blocks are declared 4 x 16 and 8 x 8, so each one holds
// elements of both trainer ranks (assembled on node-a). The expected bytes
// come from the rule written from its definition (tests/core/fp8_oracle.h)
// over the trainer's whole tensor. (The test model's values are close
// within a block, so most elements round to one byte; the scales differ
// block to block, and the in-process tests of core/fp8_sources.h and
// python/tests/fp8_test.py check every element's rounding.) With the
// trainer's ranks on the member instead, the member quantizes (for an
// instance beside it and one on the coordinator's node); with its ranks
// on both nodes, each node quantizes its rank's part, the blocks' amaxes
// combined through the coordinator.
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "core/fp8_blocks.h"
#include "tests/core/fp8_oracle.h"
#include "tests/daemon/daemon_test_support.h"
#include "tests/daemon/host_backed_gpus.h"

namespace ferry {
namespace testing {
namespace {

// The FP8 engine rank's table, in the EngineRank's shared memory: the
// trainer's down_proj [8, 16] (row-parallel there: columns 0:8 and 8:16
// on two ranks) in 4 x 16 blocks, and q_proj [8, 8] (column-parallel
// there: rows 0:4 and 4:8) in 8 x 8 blocks, each with its f32 scales.
struct Layout {
  static constexpr int64_t kDown = 0;        // 128 bytes
  static constexpr int64_t kDownScale = 128;  // [2, 1] f32
  static constexpr int64_t kQ = 192;          // 64 bytes
  static constexpr int64_t kQScale = 256;     // [1, 1] f32
};

// `q_through_loader`: q_proj flagged TRANSFORMED (its loader transforms
// it), so it goes through the engine's loader quantized, in staging.
v1::RegisterDestinationRequest Fp8Registration(const EngineRank& e,
                                               bool q_through_loader = false) {
  v1::RegisterDestinationRequest req;
  v1::DestinationRegistration* d = req.mutable_destination();
  d->set_instance_id(e.instance);
  d->set_stream(e.stream);
  d->set_tp_rank(0);
  d->set_tp_size(1);
  d->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  if (e.gpu_uuid.empty()) {
    v1::MemoryRegion* r = d->add_regions();
    r->set_region_id(0);
    r->set_size_bytes(e.memory->size());
    r->mutable_shared_memory()->set_shm_name(e.memory->name());
  } else {
    d->mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
    d->mutable_device()->set_cuda_uuid(e.gpu_uuid);
    *d->add_regions() = FakeGpuRegion(0, *e.memory, e.gpu_uuid);
  }
  auto param = [&](const std::string& name, v1::DType dtype,
                   std::vector<int64_t> shape, int64_t offset) {
    v1::EngineParameter* p = d->mutable_engine_table()->add_parameters();
    p->set_name(name);
    p->set_dtype(dtype);
    for (int64_t x : shape) p->add_local_shape(x);
    p->set_region_id(0);
    p->set_byte_offset(offset);
    p->set_loader(v1::LOADER_KIND_REPLICATED);
    p->set_loader_tp_size(1);
    return p;
  };
  v1::EngineParameter* down = param(TestModel()[3].name, v1::DTYPE_F8_E4M3,
                                    {8, 16}, Layout::kDown);
  down->mutable_fp8()->set_scale_parameter("down_scale_inv");
  down->mutable_fp8()->set_block_rows(4);
  down->mutable_fp8()->set_block_cols(16);
  param("down_scale_inv", v1::DTYPE_F32, {2, 1}, Layout::kDownScale);
  v1::EngineParameter* q =
      param(TestModel()[0].name, v1::DTYPE_F8_E4M3, {8, 8}, Layout::kQ);
  q->mutable_fp8()->set_scale_parameter("q_scale_inv");
  if (q_through_loader) q->add_flags(v1::LOADER_FLAG_TRANSFORMED);
  q->mutable_fp8()->set_block_rows(8);
  q->mutable_fp8()->set_block_cols(8);
  param("q_scale_inv", v1::DTYPE_F32, {1, 1}, Layout::kQScale);
  return req;
}

void RegisterFp8(TestDaemon& d, EngineRank& e, bool q_through_loader = false) {
  grpc::ClientContext ctx;
  v1::RegisterDestinationResponse resp;
  grpc::Status s = d.registry->RegisterDestination(
      &ctx, Fp8Registration(e, q_through_loader), &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  e.handle = resp.handle();
}

// The rule over test parameter `param` ([rows, cols] f32) at `version`,
// in `br` x `bc` blocks: the e4m3 bytes and the scales.
void Oracle(int param, int64_t rows, int64_t cols, int64_t br, int64_t bc,
            int64_t version, std::vector<uint8_t>* bytes,
            std::vector<float>* scales) {
  bytes->assign(rows * cols, 0);
  scales->clear();
  for (int64_t r0 = 0; r0 < rows; r0 += br) {
    for (int64_t c0 = 0; c0 < cols; c0 += bc) {
      float amax = 0;
      for (int64_t r = r0; r < r0 + br; ++r) {
        for (int64_t c = c0; c < c0 + bc; ++c) {
          amax = std::max(amax, std::fabs(ValueAt(param, r * cols + c, version)));
        }
      }
      amax = std::max(amax, 1e-4f);
      const float scale = 448.0f / amax;
      for (int64_t r = r0; r < r0 + br; ++r) {
        for (int64_t c = c0; c < c0 + bc; ++c) {
          (*bytes)[r * cols + c] = fp8_oracle::OracleEncode(
              ValueAt(param, r * cols + c, version) * scale,
              fp8_oracle::kE4M3Spec);
        }
      }
      scales->push_back(amax / 448.0f);
    }
  }
}

// "" or the first difference between the rank's live bytes and the rule
// (down_proj only: `down_only`, when q_proj goes through the loader).
std::string Differs(const EngineRank& e, int64_t version,
                    bool down_only = false) {
  const uint8_t* live = static_cast<const uint8_t*>(e.memory->data());
  struct Tensor {
    int param;
    int64_t rows, cols, br, bc, at, scale_at;
  };
  for (const Tensor& t : {Tensor{3, 8, 16, 4, 16, Layout::kDown,
                                 Layout::kDownScale},
                          Tensor{0, 8, 8, 8, 8, Layout::kQ, Layout::kQScale}}) {
    if (down_only && t.param == 0) continue;
    std::vector<uint8_t> bytes;
    std::vector<float> scales;
    Oracle(t.param, t.rows, t.cols, t.br, t.bc, version, &bytes, &scales);
    for (size_t i = 0; i < bytes.size(); ++i) {
      if (live[t.at + i] != bytes[i]) {
        return absl::StrCat(TestModel()[t.param].name, " byte ", i, ": 0x",
                            absl::Hex(live[t.at + i]), ", want 0x",
                            absl::Hex(bytes[i]));
      }
    }
    if (std::memcmp(live + t.scale_at, scales.data(), scales.size() * 4) != 0) {
      return absl::StrCat(TestModel()[t.param].name, "'s scales differ");
    }
  }
  return "";
}

// Version v from the TP 2 trainer on `d`: every CommitVersion answers
// `instances` instances, all committed.
void ExpectCommits(TestDaemon& d, TrainerRank& t0, TrainerRank& t1, int64_t v,
                   int instances) {
  INFO("version " << v);
  const auto outcome = RunVersion(d, {&t0, &t1}, v);
  ExpectAllCommitted(outcome);
  for (const auto& [status, resp] : outcome) {
    CHECK(resp.instances_size() == instances);
  }
}

// The daemons keep transfer checksums (off by default), so that every
// version can be verified.
DaemonOptions WithChecksums() {
  DaemonOptions o;
  o.transfer_checksums = true;
  return o;
}

// `ferryctl verify` of the instance: every FP8 byte and scale it holds
// compared with what the quantizer sent, and equal.
void ExpectVerified(TestDaemon& coordinator, const std::string& instance,
                    int64_t version, bool gpu_engine = false) {
  grpc::ClientContext ctx;
  v1::VerifyInstanceRequest req;
  req.set_instance_id(instance);
  v1::VerifyInstanceResponse r;
  grpc::Status s = coordinator.inspection->VerifyInstance(&ctx, req, &r);
  INFO(instance << ": " << s.error_message());
  REQUIRE(s.ok());
  CHECK(r.version() == version);
  CHECK(r.mismatches_size() == 0);
  if (gpu_engine) {
    // ferryd hashes host memory only: said so per parameter.
    CHECK(r.bytes_checked() == 0);
    CHECK(r.unverifiable_size() == 4);
    for (const v1::UnverifiedParameter& u : r.unverifiable()) {
      CHECK_THAT(u.reason(), Catch::Contains("GPU memory"));
    }
    return;
  }
  CHECK(r.unverifiable_size() == 0);
  CHECK(r.bytes_checked() == 128 + 2 * 4 + 64 + 4);
}

// ExplainPlan (asked of the coordinator) of the instance's two FP8
// weights: each RESOLUTION_QUANTIZED, its reason ending with `reason` (or,
// `anywhere`, containing it), its bytes the FP8 bytes and scales the rank
// receives, not the trainer's f32.
void ExpectQuantizedRows(TestDaemon& coordinator, const std::string& instance,
                         const std::string& reason, bool anywhere = false) {
  grpc::ClientContext ctx;
  v1::ExplainPlanRequest req;
  req.set_instance_id(instance);
  v1::ExplainPlanResponse plan;
  REQUIRE(coordinator.inspection->ExplainPlan(&ctx, req, &plan).ok());
  int quantized = 0;
  for (const v1::ParameterPlan& p : plan.parameters()) {
    if (p.name() != TestModel()[3].name && p.name() != TestModel()[0].name) {
      continue;
    }
    INFO(instance << " " << p.name());
    CHECK(p.resolution() == v1::RESOLUTION_QUANTIZED);
    if (anywhere) {
      CHECK_THAT(p.reason(), Catch::Contains(reason));
    } else {
      CHECK_THAT(p.reason(), Catch::EndsWith(reason));
    }
    CHECK(p.bytes() ==
          (p.name() == TestModel()[3].name ? 128 + 2 * 4 : 64 + 4));
    ++quantized;
  }
  CHECK(quantized == 2);
}

TEST_CASE("FP8 in flight to a member: the coordinator quantizes blocks "
          "that straddle its trainer ranks and sends FP8 bytes and scales",
          "[daemon][fp8][nodes]") {
  TwoNodes nodes(nullptr, nullptr, WithChecksums());
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(nodes.a, t0);
  RegisterSource(nodes.a, t1);
  EngineRank e("fp8", 0, "policy");
  RegisterFp8(nodes.b, e);
  e.Run(nodes.b.versions.get());
  for (int64_t v = 1; v <= 2; ++v) {
    INFO("version " << v);
    ExpectCommits(nodes.a, t0, t1, v, 1);
    CHECK(Differs(e, v) == "");
    ExpectVerified(nodes.a, "fp8", v);
  }
  // The member received FP8 bytes and scales, not the trainer's f32.
  ExpectQuantizedRows(nodes.a, "fp8", "; quantized on node node-a");
  e.Stop();
}

TEST_CASE("FP8 in flight from a member's trainer ranks: the member "
          "quantizes, for an instance on its own node and one on the "
          "coordinator's",
          "[daemon][fp8][nodes]") {
  TwoNodes nodes(nullptr, nullptr, WithChecksums());
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(nodes.b, t0);
  RegisterSource(nodes.b, t1);
  EngineRank here("fp8-b", 0, "policy"), there("fp8-a", 0, "policy");
  RegisterFp8(nodes.b, here);
  RegisterFp8(nodes.a, there);
  here.Run(nodes.b.versions.get());
  there.Run(nodes.a.versions.get());
  for (int64_t v = 1; v <= 3; ++v) {
    INFO("version " << v);
    ExpectCommits(nodes.b, t0, t1, v, 2);
    CHECK(Differs(here, v) == "");
    CHECK(Differs(there, v) == "");
    ExpectVerified(nodes.a, "fp8-a", v);
    ExpectVerified(nodes.a, "fp8-b", v);
  }
  ExpectQuantizedRows(nodes.a, "fp8-a", "; quantized on node node-b");
  here.Stop();
  there.Stop();
}

TEST_CASE("FP8 in flight from trainer ranks in GPU memory into an FP8 "
          "engine on a GPU (host-backed GPUs): the quantize step reads them "
          "through the host, on the coordinator's node and on a member",
          "[daemon][fp8][nodes][gpu]") {
  GpuCounters a_gpus, b_gpus;  // outlive the daemons
  TwoNodes nodes(HostBackedGpus(&a_gpus), HostBackedGpus(&b_gpus),
                 WithChecksums());
  const bool on_member = GENERATE(false, true);
  INFO((on_member ? "trainer on the member" : "trainer on the coordinator"));
  TestDaemon& trainer_at = on_member ? nodes.b : nodes.a;
  GpuCounters& trainer_gpus = on_member ? b_gpus : a_gpus;
  TrainerRank t0(0, "policy"), t1(1, "policy");
  t0.gpu_uuid = t1.gpu_uuid = "GPU-fake-1";
  RegisterSource(trainer_at, t0);
  RegisterSource(trainer_at, t1);
  EngineRank e("fp8", 0, "policy");
  e.gpu_uuid = "GPU-fake-0";  // the FP8 engine's weights on a GPU too
  RegisterFp8(nodes.b, e);
  e.Run(nodes.b.versions.get());
  const int64_t before = trainer_gpus.bytes_by_gpu[1].load();
  for (int64_t v = 1; v <= 2; ++v) {
    INFO("version " << v);
    ExpectCommits(trainer_at, t0, t1, v, 1);
    CHECK(Differs(e, v) == "");
    ExpectVerified(nodes.a, "fp8", v, /*gpu_engine=*/true);
  }
  // The trainer's f32 of q_proj [8, 8] and down_proj [8, 16], read from
  // its GPU by that GPU's copy engine once per version.
  CHECK(trainer_gpus.bytes_by_gpu[1].load() - before == 2 * 4 * (64 + 128));
  e.Stop();
}

TEST_CASE("FP8 replicas on two members exchange quantized buckets",
          "[daemon][fp8][exchange][nodes]") {
  // q_proj through the loader puts staging in both instances, so neither
  // relays between daemons; 16-byte buckets make several to exchange.
  DaemonOptions o;
  o.exchange = true;
  o.bucket_bytes = 16;
  o.relay_wait_ms = 200;
  Nodes nodes(2, o);
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(*nodes.coordinator, t0);
  RegisterSource(*nodes.coordinator, t1);
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (int k = 0; k < 2; ++k) {
    engines.push_back(
        std::make_unique<EngineRank>(k == 0 ? "r0" : "r1", 0, "policy"));
    RegisterFp8(*nodes.members[k], *engines.back(), /*q_through_loader=*/true);
    engines.back()->Run(nodes.members[k]->versions.get());
  }
  for (int64_t v = 1; v <= 2; ++v) {
    INFO("version " << v);
    ExpectCommits(*nodes.coordinator, t0, t1, v, 2);
    for (auto& e : engines) CHECK(Differs(*e, v, /*down_only=*/true) == "");
    const v1::GetProgressResponse progress =
        ProgressOf(*nodes.coordinator, "policy", v);
    REQUIRE(progress.instances_size() == 2);
    std::map<std::string, std::string> given;
    for (const v1::InstanceProgress& i : progress.instances()) {
      given[i.status().instance_id()] = i.given_by();
    }
    CHECK(given["r0"] == "r1");
    CHECK(given["r1"] == "r0");
  }
  for (auto& e : engines) e->Stop();
}

TEST_CASE("FP8 in flight of tensors whose trainer ranks span nodes (FSDP "
          "over nodes): each node quantizes the parts it holds with every "
          "block's amax combined, and the bytes are the whole tensor's",
          "[daemon][fp8][nodes]") {
  // With trainer ranks in GPU memory too (host-backed GPUs): each node's
  // block amaxes and parts are read through the host.
  const bool gpu = GENERATE(false, true);
  INFO((gpu ? "trainer in GPU memory" : "trainer in host memory"));
  GpuCounters a_gpus, b_gpus;  // outlive the daemons
  TwoNodes nodes(gpu ? HostBackedGpus(&a_gpus) : nullptr,
                 gpu ? HostBackedGpus(&b_gpus) : nullptr, WithChecksums());
  // Every block holds elements of both ranks, so of both nodes.
  TrainerRank t0(0, "policy"), t1(1, "policy");
  if (gpu) t0.gpu_uuid = t1.gpu_uuid = "GPU-fake-1";
  RegisterSource(nodes.a, t0);
  RegisterSource(nodes.b, t1);
  EngineRank here("fp8-b", 0, "policy"), there("fp8-a", 0, "policy");
  RegisterFp8(nodes.b, here);
  RegisterFp8(nodes.a, there);
  here.Run(nodes.b.versions.get());
  there.Run(nodes.a.versions.get());
  for (int64_t v = 1; v <= 3; ++v) {
    INFO("version " << v);
    const auto outcome = RunVersion(nodes.b, {&t0, &t1}, v);
    for (const auto& [status, resp] : outcome) {
      INFO(status.error_message());
      REQUIRE(status.ok());
      for (const v1::InstanceStatus& i : resp.instances()) {
        INFO(i.instance_id() << ": " << i.abort_reason());
        CHECK(i.state() == v1::INSTANCE_STATE_COMMITTED);
      }
    }
    CHECK(Differs(here, v) == "");
    CHECK(Differs(there, v) == "");
    ExpectVerified(nodes.a, "fp8-a", v);
    ExpectVerified(nodes.a, "fp8-b", v);
  }
  if (gpu) {
    // Each node read its own rank's f32 of both tensors from its GPU, for
    // the amaxes and again for the parts: twice per version.
    CHECK(a_gpus.bytes_by_gpu[1].load() == 3 * 2 * 4 * (64 + 128) / 2);
    CHECK(b_gpus.bytes_by_gpu[1].load() == 3 * 2 * 4 * (64 + 128) / 2);
  }
  // FP8 bytes and scales only: no f32 crossed.
  ExpectQuantizedRows(nodes.a, "fp8-b",
                      "; split over trainer nodes, quantized on node-a, "
                      "node-b with block amaxes combined",
                      /*anywhere=*/true);
  here.Stop();
  there.Stop();
}

}  // namespace
}  // namespace testing
}  // namespace ferry
