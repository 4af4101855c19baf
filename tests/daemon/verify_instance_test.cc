// Inspection.VerifyInstance end to end in one process (real gRPC, real
// shared memory): a TP2 trainer feeds TP4 instances; after a commit every
// box an engine rank holds is compared with the checksum of what left the
// trainer, and a byte scribbled into one rank's memory is named by
// parameter, rank and box. On one node and across two (TwoNodes).
#include <cstring>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"
#include "tests/daemon/host_backed_gpus.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

// Engine rank memory (floats): qkv [6, 8] at 0, down_proj [8, 4] at 48 (its
// columns 4r..4r+4), norm [8] at 80, lm_head at 88 (daemon_test_support).
constexpr int64_t kDownAt = 48;

// Transfer checksums are off by default (daemon_options.h).
DaemonOptions WithChecksums(DaemonOptions o = DaemonOptions()) {
  o.transfer_checksums = true;
  return o;
}
const char kDown[] = "model.layers.0.mlp.down_proj.weight";
const char kLmHead[] = "lm_head.weight";

struct Fleet {
  // Trainer ranks register at `trainer`, instance i's ranks at `at[i]`;
  // trainer ranks on GPU `trainer_gpu`, engine rank r on `engine_gpu(r)`
  // ("": host memory; host_backed_gpus.h).
  Fleet(TestDaemon* trainer, std::vector<TestDaemon*> at,
        bool lm_head_direct = false, const std::string& trainer_gpu = "",
        std::string (*engine_gpu)(int) = nullptr)
      : trainer(trainer) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      trainers.back()->gpu_uuid = trainer_gpu;
      RegisterSource(*trainer, *trainers.back());
    }
    for (size_t i = 0; i < at.size(); ++i) {
      for (int r = 0; r < 4; ++r) {
        engines.push_back(std::make_unique<EngineRank>(
            "r" + std::to_string(i), r, "policy"));
        engines.back()->lm_head_direct = lm_head_direct;
        if (engine_gpu != nullptr) engines.back()->gpu_uuid = engine_gpu(r);
        RegisterDestination(*at[i], *engines.back());
        engines.back()->Run(at[i]->versions.get());
      }
    }
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }
  std::vector<TrainerRank*> sources() {
    return {trainers[0].get(), trainers[1].get()};
  }
  void Commit(int64_t v) {
    std::vector<EngineRank*> ranks;
    for (auto& e : engines) ranks.push_back(e.get());
    ExpectVersionCommits(*trainer, sources(), ranks,
                         v, static_cast<int>(engines.size() / 4));
  }
  EngineRank& rank(int instance, int tp_rank) {
    return *engines[instance * 4 + tp_rank];
  }
  TestDaemon* trainer;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

grpc::Status Verify(TestDaemon& d, const std::string& instance,
                    v1::VerifyInstanceResponse* out) {
  grpc::ClientContext ctx;
  v1::VerifyInstanceRequest req;
  req.set_instance_id(instance);
  return d.inspection->VerifyInstance(&ctx, req, out);
}

// Verifies and requires the call to succeed.
v1::VerifyInstanceResponse Verified(TestDaemon& d,
                                    const std::string& instance) {
  v1::VerifyInstanceResponse r;
  grpc::Status s = Verify(d, instance, &r);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return r;
}

float* Floats(EngineRank& e) {
  return reinterpret_cast<float*>(e.memory->data());
}

// The clean report of an instance with lm_head through staging: q, k, v,
// down_proj and norm compared (5 boxes per rank: a rank's rows of q, k and
// v each come from one trainer rank, its down_proj columns from one, the
// norm from one replica), lm_head not verifiable.
void ExpectCleanWithFallback(const v1::VerifyInstanceResponse& r,
                             int64_t version) {
  CHECK(r.version() == version);
  CHECK(r.algorithm() == "xxh3_64");
  CHECK(r.mismatches_size() == 0);
  CHECK(r.parameters_checked() == 5);
  CHECK(r.boxes_checked() == 4 * 5);
  CHECK(r.bytes_checked() == 4 * (192 + 128 + 32));
  CHECK(r.bytes_unverifiable() == 4 * 512);
  REQUIRE(r.unverifiable_size() == 4);
  for (int rank = 0; rank < 4; ++rank) {
    const v1::UnverifiedParameter& u = r.unverifiable(rank);
    CHECK(u.parameter() == kLmHead);
    CHECK(u.tp_rank() == rank);
    CHECK(u.bytes() == 512);
    CHECK(u.reason().rfind("not verifiable (fallback)", 0) == 0);
  }
}

// Scribbles on element [row, col] of down_proj's local [8, 4] block of
// `e`, which is down_proj[row, 4 * tp_rank + col]; returns the old value.
float Scribble(EngineRank& e, int row, int col, float value) {
  float* at = Floats(e) + kDownAt + row * 4 + col;
  const float old = *at;
  *at = value;
  return old;
}

// The one mismatch a scribble on down_proj of tp rank `rank` gives: the
// rank's columns [4r, 4r+4) of all 8 rows, one copy from one trainer rank.
void ExpectDownMismatch(const v1::VerifyInstanceResponse& r, int rank,
                        const std::string& node) {
  REQUIRE(r.mismatches_size() == 1);
  const v1::ChecksumMismatch& m = r.mismatches(0);
  CHECK(m.parameter() == kDown);
  CHECK(m.tp_rank() == rank);
  REQUIRE(m.box().offset_size() == 2);
  CHECK(m.box().offset(0) == 0);
  CHECK(m.box().offset(1) == 4 * rank);
  CHECK(m.box().extent(0) == 8);
  CHECK(m.box().extent(1) == 4);
  CHECK(m.expected() != m.actual());
  CHECK(m.node() == node);
}

}  // namespace

TEST_CASE("VerifyInstance compares every direct box and names a scribble",
          "[daemon][verify]") {
  TestDaemon daemon(WithChecksums());
  Fleet fleet(&daemon, {&daemon, &daemon});
  fleet.Commit(1);
  fleet.Commit(2);

  ExpectCleanWithFallback(Verified(daemon, "r0"), 2);
  // r1 relayed from r0 on this node: its memory is compared with the
  // checksums of what left the trainer for r0.
  const v1::VerifyInstanceResponse r1 = Verified(daemon, "r1");
  ExpectCleanWithFallback(r1, 2);
  CHECK(r1.relayed_from() == "r0");

  // One element of down_proj on r0's tp rank 2.
  const float old = Scribble(fleet.rank(0, 2), 5, 1, -1.0f);
  const v1::VerifyInstanceResponse bad = Verified(daemon, "r0");
  ExpectDownMismatch(bad, 2, "localhost");
  CHECK(bad.boxes_checked() == 20);
  CHECK(Verified(daemon, "r1").mismatches_size() == 0);

  // Put back: clean again. The next version brings new checksums.
  Scribble(fleet.rank(0, 2), 5, 1, old);
  CHECK(Verified(daemon, "r0").mismatches_size() == 0);
  fleet.Commit(3);
  ExpectCleanWithFallback(Verified(daemon, "r0"), 3);
  ExpectCleanWithFallback(Verified(daemon, "r1"), 3);

  // A scribble into a replica that relayed is its own mismatch.
  Scribble(fleet.rank(1, 0), 0, 3, 7.0f);
  ExpectDownMismatch(Verified(daemon, "r1"), 0, "localhost");
  CHECK(Verified(daemon, "r0").mismatches_size() == 0);
}

TEST_CASE("VerifyInstance of a rank whose memory was shrunk says so",
          "[daemon][verify]") {
  // The hash of a shrunk region faults (SIGBUS) in ferryd; the box is
  // reported unverifiable and the daemon carries on.
  TestDaemon daemon(WithChecksums());
  Fleet fleet(&daemon, {&daemon}, /*lm_head_direct=*/true);
  fleet.Commit(1);
  Shrink(*fleet.rank(0, 1).memory);
  const v1::VerifyInstanceResponse r = Verified(daemon, "r0");
  CHECK(r.mismatches_size() == 0);
  CHECK(r.boxes_checked() == 3 * 6);
  REQUIRE(r.unverifiable_size() == 6);
  for (const v1::UnverifiedParameter& u : r.unverifiable()) {
    INFO(u.parameter() << ": " << u.reason());
    CHECK(u.tp_rank() == 1);
    CHECK(absl::StrContains(u.reason(), "no longer backed"));
  }
  ExpectAnswers(daemon);
}

TEST_CASE("VerifyInstance with every byte direct has nothing unverifiable",
          "[daemon][verify]") {
  TestDaemon daemon(WithChecksums());
  Fleet fleet(&daemon, {&daemon}, /*lm_head_direct=*/true);
  fleet.Commit(1);
  const v1::VerifyInstanceResponse r = Verified(daemon, "r0");
  CHECK(r.mismatches_size() == 0);
  CHECK(r.unverifiable_size() == 0);
  CHECK(r.parameters_checked() == 6);
  // Per rank: q, k, v, down_proj, norm and its 4 vocab rows of lm_head.
  CHECK(r.boxes_checked() == 4 * 6);
  CHECK(r.bytes_checked() == 4 * (192 + 128 + 32 + 128));
  // lm_head rows of tp rank 3 are vocab rows 12..15 at float 88.
  Floats(fleet.rank(0, 3))[88 + 8 * 2 + 5] += 1.0f;
  const v1::VerifyInstanceResponse bad = Verified(daemon, "r0");
  REQUIRE(bad.mismatches_size() == 1);
  CHECK(bad.mismatches(0).parameter() == kLmHead);
  CHECK(bad.mismatches(0).tp_rank() == 3);
  CHECK(bad.mismatches(0).box().offset(0) == 12);
  CHECK(bad.mismatches(0).box().extent(0) == 4);
}

TEST_CASE("VerifyInstance refuses what it cannot compare",
          "[daemon][verify]") {
  DaemonOptions options;
  options.ack_timeout_ms = 1500;
  TestDaemon daemon(WithChecksums(options));
  Fleet fleet(&daemon, {&daemon});

  v1::VerifyInstanceResponse r;
  SECTION("an unknown instance") {
    CHECK(Verify(daemon, "nope", &r).error_code() == grpc::NOT_FOUND);
  }
  SECTION("no version delivered yet") {
    grpc::Status s = Verify(daemon, "r0", &r);
    CHECK(s.error_code() == grpc::FAILED_PRECONDITION);
    CHECK(s.error_message().find("no checksums kept for version 0") !=
          std::string::npos);
  }
  SECTION("a version in progress, then a clean abort keeps the old one") {
    fleet.Commit(1);
    // tp rank 1 never acks PAUSE of version 2: the instance stays in
    // PREPARE until the ack timeout aborts it, clean.
    fleet.rank(0, 1).hang_version = 2;
    fleet.rank(0, 1).hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;
    auto version2 = std::async(std::launch::async, [&] {
      return RunVersion(daemon, fleet.sources(), 2);
    });
    grpc::Status s;
    Eventually(
        [&] {
          s = Verify(daemon, "r0", &r);
          return s.error_code() == grpc::FAILED_PRECONDITION;
        },
        absl::Seconds(1), absl::Milliseconds(5));
    CHECK(s.error_code() == grpc::FAILED_PRECONDITION);
    CHECK(s.error_message().find("version 2 is in progress") !=
          std::string::npos);
    for (const auto& [status, outcome] : version2.get()) {
      REQUIRE(status.ok());
      REQUIRE(outcome.instances_size() == 1);
      CHECK(outcome.instances(0).state() == v1::INSTANCE_STATE_ABORTED);
      CHECK_FALSE(outcome.instances(0).dirty());
    }
    // Nothing was written: version 1 is still there, and still checks.
    const v1::VerifyInstanceResponse after = Verified(daemon, "r0");
    CHECK(after.version() == 1);
    CHECK(after.mismatches_size() == 0);
  }
}

TEST_CASE("VerifyInstance is refused when transfer checksums are off",
          "[daemon][verify]") {
  TestDaemon daemon;  // the default: off
  Fleet fleet(&daemon, {&daemon});
  fleet.Commit(1);
  v1::VerifyInstanceResponse r;
  grpc::Status s = Verify(daemon, "r0", &r);
  CHECK(s.error_code() == grpc::FAILED_PRECONDITION);
  CHECK(s.error_message().find("without --transfer_checksums") !=
        std::string::npos);
}

std::string FirstTwoOnGpu(int r) { return r < 2 ? "GPU-fake-0" : ""; }

TEST_CASE("VerifyInstance reports GPU memory as not verified",
          "[daemon][verify][gpu]") {
  GpuCounters counters;
  TestDaemon daemon(WithChecksums(), HostBackedGpus(&counters));
  SECTION("engine ranks 0 and 1 on a GPU, 2 and 3 in host memory") {
    Fleet fleet(&daemon, {&daemon}, false, "", FirstTwoOnGpu);
    fleet.Commit(1);
    const v1::VerifyInstanceResponse r = Verified(daemon, "r0");
    CHECK(r.mismatches_size() == 0);
    CHECK(r.boxes_checked() == 2 * 5);
    CHECK(r.bytes_checked() == 2 * (192 + 128 + 32));
    CHECK(r.bytes_unverifiable() == 4 * 512 + 2 * (192 + 128 + 32));
    int gpu = 0, fallback = 0;
    for (const v1::UnverifiedParameter& u : r.unverifiable()) {
      if (u.reason().rfind("not verified: GPU memory (engine rank", 0) == 0) {
        CHECK(u.tp_rank() < 2);
        ++gpu;
      } else {
        CHECK(u.parameter() == kLmHead);
        ++fallback;
      }
    }
    CHECK(gpu == 2 * 5);  // q, k, v, down_proj, norm on ranks 0 and 1
    CHECK(fallback == 4);
    Scribble(fleet.rank(0, 3), 1, 1, 9.0f);
    ExpectDownMismatch(Verified(daemon, "r0"), 3, "localhost");
  }
  SECTION("trainer ranks on a GPU: nothing could be hashed at the source") {
    Fleet fleet(&daemon, {&daemon}, /*lm_head_direct=*/true, "GPU-fake-0");
    fleet.Commit(1);
    const v1::VerifyInstanceResponse r = Verified(daemon, "r0");
    CHECK(r.boxes_checked() == 0);
    CHECK(r.parameters_checked() == 0);
    CHECK(r.bytes_unverifiable() == 4 * (192 + 128 + 32 + 128));
    REQUIRE(r.unverifiable_size() > 0);
    for (const v1::UnverifiedParameter& u : r.unverifiable()) {
      CHECK(u.reason().rfind("not verified: GPU memory (source rank", 0) == 0);
    }
  }
}

TEST_CASE("VerifyInstance across nodes: member ranks and member sources",
          "[daemon][verify][nodes]") {
  TwoNodes nodes(nullptr, nullptr, WithChecksums());
  SECTION("trainer on the coordinator, the instance on the member") {
    Fleet fleet(&nodes.a, {&nodes.b}, /*lm_head_direct=*/true);
    fleet.Commit(1);
    // Asked at the member (forwarded to the coordinator) or the coordinator.
    for (TestDaemon* d : {&nodes.a, &nodes.b}) {
      const v1::VerifyInstanceResponse r = Verified(*d, "r0");
      CHECK(r.mismatches_size() == 0);
      CHECK(r.boxes_checked() == 24);
      CHECK(r.unverifiable_size() == 0);
    }
    Scribble(fleet.rank(0, 1), 7, 3, 123.0f);
    ExpectDownMismatch(Verified(nodes.a, "r0"), 1, "node-b");
  }
  SECTION("trainer on the member, the instance on the coordinator") {
    Fleet fleet(&nodes.b, {&nodes.a}, /*lm_head_direct=*/true);
    fleet.Commit(1);
    const v1::VerifyInstanceResponse r = Verified(nodes.a, "r0");
    CHECK(r.mismatches_size() == 0);
    CHECK(r.boxes_checked() == 24);
    CHECK(r.unverifiable_size() == 0);
    Scribble(fleet.rank(0, 3), 0, 0, 5.5f);
    ExpectDownMismatch(Verified(nodes.b, "r0"), 3, "node-a");
  }
  SECTION("trainer and instance on the member") {
    Fleet fleet(&nodes.b, {&nodes.b});
    fleet.Commit(1);
    ExpectCleanWithFallback(Verified(nodes.b, "r0"), 1);
    Scribble(fleet.rank(0, 0), 2, 2, 0.25f);
    ExpectDownMismatch(Verified(nodes.b, "r0"), 0, "node-b");
  }
}

}  // namespace testing
}  // namespace ferry
