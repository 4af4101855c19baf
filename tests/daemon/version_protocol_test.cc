// ferryd end to end in one process: real gRPC over a real unix socket, real
// shared memory. A TP2 trainer feeds two TP4 engine instances (fused qkv,
// row-parallel down_proj, replicated norm, lm_head through a custom loader
// = fallback via staging); every destination byte is checked.
#include <atomic>
#include <thread>

#include "absl/time/time.h"
#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

struct Fleet {
  explicit Fleet(DaemonOptions options = DaemonOptions()) : daemon(options) {
    trainers.push_back(std::make_unique<TrainerRank>(0, "policy"));
    trainers.push_back(std::make_unique<TrainerRank>(1, "policy"));
    for (const char* id : {"r0", "r1"}) {
      for (int r = 0; r < 4; ++r) {
        engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
      }
    }
    for (auto& t : trainers) RegisterSource(daemon, *t);
    for (auto& e : engines) RegisterDestination(daemon, *e);
    for (auto& e : engines) e->Run(daemon.versions.get());
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }
  std::vector<TrainerRank*> sources() {
    return {trainers[0].get(), trainers[1].get()};
  }
  TestDaemon daemon;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

const v1::InstanceStatus* Find(const v1::CommitVersionResponse& r,
                               const std::string& id) {
  for (const auto& s : r.instances()) {
    if (s.instance_id() == id) return &s;
  }
  return nullptr;
}

}  // namespace

TEST_CASE("three versions land byte-exact in two TP4 instances",
          "[daemon][version]") {
  Fleet fleet;
  std::vector<EngineRank*> engines;
  for (auto& e : fleet.engines) engines.push_back(e.get());
  for (int64_t v = 1; v <= 3; ++v) {
    ExpectVersionCommits(fleet.daemon, fleet.sources(), engines, v, 2);
  }

  SECTION("inspection reports the versions, the plan and the progress") {
    grpc::ClientContext c1;
    v1::ListStreamsRequest ls;
    v1::ListStreamsResponse streams;
    REQUIRE(fleet.daemon.inspection->ListStreams(&c1, ls, &streams).ok());
    REQUIRE(streams.streams_size() == 1);
    const v1::StreamInfo& info = streams.streams(0);
    CHECK(info.latest_committed_version() == 3);
    CHECK(info.version_in_progress() == 0);
    CHECK(info.parameter_count() == 6);
    REQUIRE(info.instances_size() == 2);
    CHECK(info.instances(0).status().state() == v1::INSTANCE_STATE_COMMITTED);

    grpc::ClientContext c2;
    v1::ExplainPlanRequest ep;
    ep.set_instance_id("r0");
    ep.set_tp_rank(1);
    v1::ExplainPlanResponse plan;
    grpc::Status s = fleet.daemon.inspection->ExplainPlan(&c2, ep, &plan);
    INFO(s.error_message());
    REQUIRE(s.ok());
    CHECK(plan.plan_digest().size() == 16);
    REQUIRE(plan.parameters_size() == 4);
    bool saw_fused = false, saw_fallback = false;
    for (const auto& p : plan.parameters()) {
      CHECK(p.tp_rank() == 1);
      if (p.name() == "model.layers.0.self_attn.qkv_proj.weight") {
        saw_fused = p.resolution() == v1::RESOLUTION_FUSED &&
                    p.bytes() == 6 * 8 * 4 && p.source_ranks_size() == 1;
      }
      if (p.name() == "lm_head.weight") {
        saw_fallback = p.resolution() == v1::RESOLUTION_FALLBACK &&
                       p.bytes() == 16 * 8 * 4 && p.source_ranks_size() == 2;
      }
    }
    CHECK(saw_fused);
    CHECK(saw_fallback);
    // Per rank: qkv 192 + down 128 + norm 32 direct; lm_head 512 fallback.
    CHECK(plan.totals().total_bytes() == 4 * (192 + 128 + 32 + 512));
    CHECK(plan.totals().fallback_bytes() == 4 * 512);

    grpc::ClientContext c3;
    v1::GetProgressRequest gp;
    gp.set_stream("policy");
    v1::GetProgressResponse progress;
    REQUIRE(fleet.daemon.inspection->GetProgress(&c3, gp, &progress).ok());
    CHECK(progress.version() == 3);
    CHECK(progress.instances_committed() == 2);
    CHECK(progress.bytes_moved() == progress.bytes_total());
    CHECK(progress.bytes_total() == 2 * 4 * (192 + 128 + 32 + 512));
    CHECK(progress.throughput_bytes_per_second() > 0);

    grpc::ClientContext c4;
    v1::ListParticipantsRequest lp;
    v1::ListParticipantsResponse parts;
    REQUIRE(fleet.daemon.inspection->ListParticipants(&c4, lp, &parts).ok());
    CHECK(parts.participants_size() == 10);
    for (const auto& p : parts.participants()) {
      if (p.has_destination()) CHECK(p.destination().subscribed());
    }

    grpc::ClientContext c5;
    v1::WaitForVersionRequest w;
    w.set_stream("policy");
    w.set_version(2);
    w.set_timeout_ms(1000);
    v1::WaitForVersionResponse waited;
    REQUIRE(fleet.daemon.versions->WaitForVersion(&c5, w, &waited).ok());
    CHECK(waited.instances_size() == 2);
  }
}

// Found by fault_test on a slow run: engines that exit after their last
// version took the stream out of the registry, and WaitForVersion, which
// asked the registry first, answered NOT_FOUND for a version that had
// committed.
TEST_CASE("WaitForVersion answers from the daemon's record after every rank "
          "has left", "[daemon][version]") {
  Fleet fleet;
  std::vector<EngineRank*> engines;
  for (auto& e : fleet.engines) engines.push_back(e.get());
  ExpectVersionCommits(fleet.daemon, fleet.sources(), engines, 1, 2);
  auto leave = [&](const v1::ParticipantHandle& h) {
    grpc::ClientContext ctx;
    v1::DeregisterRequest req;
    *req.mutable_handle() = h;
    v1::DeregisterResponse resp;
    REQUIRE(fleet.daemon.registry->Deregister(&ctx, req, &resp).ok());
  };
  for (auto& e : fleet.engines) {
    e->Stop();
    leave(e->handle);
  }
  for (auto& t : fleet.trainers) leave(t->handle);
  auto wait = [&](const std::string& stream, int64_t v,
                  v1::WaitForVersionResponse* out) {
    grpc::ClientContext ctx;
    v1::WaitForVersionRequest w;
    w.set_stream(stream);
    w.set_version(v);
    w.set_timeout_ms(1000);
    return fleet.daemon.versions->WaitForVersion(&ctx, w, out);
  };
  v1::WaitForVersionResponse waited;
  grpc::Status s = wait("policy", 1, &waited);
  INFO(s.error_message());
  REQUIRE(s.ok());
  REQUIRE(waited.instances_size() == 2);
  for (const auto& i : waited.instances()) {
    CHECK(i.state() == v1::INSTANCE_STATE_COMMITTED);
    CHECK(i.committed_version() == 1);
  }
  v1::WaitForVersionResponse none;
  CHECK(wait("policy", 2, &none).error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(wait("nope", 1, &none).error_code() == grpc::StatusCode::NOT_FOUND);
}

TEST_CASE("ranks holding different versions register; the instance counts "
          "as the lowest and the next version commits on every rank",
          "[daemon][version]") {
  // Rank 0 kept version 5 (it registered again after its daemon
  // restarted); ranks 1-3 restarted with the base weights. Found by the
  // chaos soak: the second registration used to be INVALID_ARGUMENT, so a
  // restarted rank could never rejoin its instance.
  TestDaemon d;
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(d, t0);
  RegisterSource(d, t1);
  std::vector<std::unique_ptr<EngineRank>> ranks;
  std::vector<EngineRank*> engines;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
    engines.push_back(ranks.back().get());
    v1::RegisterDestinationRequest req = ranks.back()->Registration();
    req.mutable_destination()->set_held_version(r == 0 ? 5 : 0);
    grpc::ClientContext c;
    v1::RegisterDestinationResponse resp;
    grpc::Status s = d.registry->RegisterDestination(&c, req, &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
    ranks.back()->handle = resp.handle();
  }
  grpc::ClientContext c;
  v1::ListStreamsResponse streams;
  REQUIRE(d.inspection->ListStreams(&c, {}, &streams).ok());
  REQUIRE(streams.streams_size() == 1);
  REQUIRE(streams.streams(0).instances_size() == 1);
  CHECK(streams.streams(0).instances(0).status().committed_version() == 0);
  for (EngineRank* e : engines) e->Run(d.versions.get());
  ExpectVersionCommits(d, {&t0, &t1}, engines, 6, 1);
  for (EngineRank* e : engines) e->Stop();
}

TEST_CASE("a rank that registers again holding less lowers its instance's "
          "committed_version until the next version commits",
          "[daemon][version]") {
  // Found by the chaos soak: after a rank restarted (base weights) its
  // instance was still listed COMMITTED at the version before.
  TestDaemon d;
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(d, t0);
  RegisterSource(d, t1);
  std::vector<std::unique_ptr<EngineRank>> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
    RegisterDestination(d, *ranks.back());
    ranks.back()->Run(d.versions.get());
  }
  auto engines = [&] {
    std::vector<EngineRank*> out;
    for (auto& e : ranks) out.push_back(e.get());
    return out;
  };
  ExpectVersionCommits(d, {&t0, &t1}, engines(), 1, 1);
  auto listed = [&] {
    grpc::ClientContext c;
    v1::ListStreamsResponse streams;
    REQUIRE(d.inspection->ListStreams(&c, {}, &streams).ok());
    REQUIRE(streams.streams_size() == 1);
    REQUIRE(streams.streams(0).instances_size() == 1);
    return streams.streams(0).instances(0).status();
  };
  CHECK(listed().state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(listed().committed_version() == 1);

  // Rank 2 restarts with the base weights and takes its rank back.
  ranks[2]->Stop();
  ranks[2] = std::make_unique<EngineRank>("r0", 2, "policy");
  v1::RegisterDestinationRequest req = ranks[2]->Registration();
  req.set_replace_existing(true);
  grpc::ClientContext c;
  v1::RegisterDestinationResponse resp;
  REQUIRE(d.registry->RegisterDestination(&c, req, &resp).ok());
  ranks[2]->handle = resp.handle();
  ranks[2]->Run(d.versions.get());
  CHECK(listed().state() == v1::INSTANCE_STATE_IDLE);
  CHECK(listed().committed_version() == 0);

  ExpectVersionCommits(d, {&t0, &t1}, engines(), 2, 1);
  CHECK(listed().state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(listed().committed_version() == 2);
  for (auto& e : ranks) e->Stop();
}

TEST_CASE("a rank that stops acking aborts only its instance",
          "[daemon][version][failure]") {
  DaemonOptions options;
  options.ack_timeout_ms = 500;
  options.version_timeout_ms = 20000;
  Fleet fleet(options);
  // r1's tp rank 2 never acks PAUSE of version 2.
  EngineRank& stuck = *fleet.engines[4 + 2];
  stuck.hang_version = 2;
  stuck.hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;

  for (int64_t v = 1; v <= 3; ++v) {
    auto outcomes = RunVersion(fleet.daemon, fleet.sources(), v);
    for (auto& [status, resp] : outcomes) {
      INFO("version " << v << ": " << status.error_message());
      REQUIRE(status.ok());
      const v1::InstanceStatus* r0 = Find(resp, "r0");
      const v1::InstanceStatus* r1 = Find(resp, "r1");
      REQUIRE(r0 != nullptr);
      REQUIRE(r1 != nullptr);
      INFO(r0->DebugString() << r1->DebugString());
      CHECK(r0->state() == v1::INSTANCE_STATE_COMMITTED);
      if (v == 2) {
        CHECK(r1->state() == v1::INSTANCE_STATE_ABORTED);
        CHECK(r1->committed_version() == 1);
        CHECK_FALSE(r1->dirty());  // nothing was written before PAUSE
        CHECK(r1->abort_reason().find("tp rank 2 did not ack PAUSE") !=
              std::string::npos);
      } else {
        CHECK(r1->state() == v1::INSTANCE_STATE_COMMITTED);
        CHECK(r1->committed_version() == v);
      }
    }
    for (int i = 0; i < 4; ++i) {
      CHECK(fleet.engines[i]->Check(v) == "");  // r0 always has v
    }
    if (v == 3) {
      for (int i = 4; i < 8; ++i) CHECK(fleet.engines[i]->Check(3) == "");
    }
  }
  std::lock_guard<std::mutex> lock(stuck.mu);
  bool saw_abort = false;
  for (const std::string& line : stuck.log) {
    saw_abort |= line == "UPDATE_EVENT_KIND_ABORT 2";
  }
  CHECK(saw_abort);
}

TEST_CASE("a FAILED APPLY ack aborts the instance dirty; the next version "
          "repairs it",
          "[daemon][version][failure]") {
  Fleet fleet;
  EngineRank& failing = *fleet.engines[4 + 1];  // r1 tp rank 1
  failing.fail_version = 2;
  failing.fail_kind = v1::UPDATE_EVENT_KIND_APPLY;
  for (int64_t v = 1; v <= 3; ++v) {
    auto outcomes = RunVersion(fleet.daemon, fleet.sources(), v);
    REQUIRE(outcomes[0].first.ok());
    const v1::InstanceStatus* r0 = Find(outcomes[0].second, "r0");
    const v1::InstanceStatus* r1 = Find(outcomes[0].second, "r1");
    REQUIRE(r0 != nullptr);
    REQUIRE(r1 != nullptr);
    INFO(r1->DebugString());
    CHECK(r0->state() == v1::INSTANCE_STATE_COMMITTED);
    if (v == 2) {
      CHECK(r1->state() == v1::INSTANCE_STATE_ABORTED);
      CHECK(r1->dirty());  // live buffers were written
      CHECK(r1->committed_version() == 1);
      CHECK(r1->abort_reason().find("tp rank 1 failed APPLY: load_weights") !=
            std::string::npos);
    } else {
      CHECK(r1->state() == v1::INSTANCE_STATE_COMMITTED);
      CHECK_FALSE(r1->dirty());
      CHECK(r1->committed_version() == v);
    }
  }
  for (auto& e : fleet.engines) CHECK(e->Check(3) == "");
}

TEST_CASE("AbortVersion aborts every instance and CommitVersion returns "
          "ABORTED", "[daemon][version][failure]") {
  Fleet fleet;
  REQUIRE(RunVersion(fleet.daemon, fleet.sources(), 1)[0].first.ok());
  grpc::ClientContext c;
  v1::AbortVersionRequest abort;
  *abort.mutable_handle() = fleet.trainers[0]->handle;
  abort.set_version(7);
  abort.set_reason("optimizer step failed");
  v1::AbortVersionResponse resp;
  grpc::Status s = fleet.daemon.versions->AbortVersion(&c, abort, &resp);
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("AbortVersion(7)") != std::string::npos);

  // Rank 0 begins 2 and commits on a thread; rank 1 aborts instead. The
  // thread only records what it got (Catch2 asserts on this thread only).
  grpc::Status begin_status, commit_status;
  std::atomic<bool> rank0_done{false};
  std::thread rank0([&] {
    v1::BeginVersionRequest begin;
    *begin.mutable_handle() = fleet.trainers[0]->handle;
    begin.set_version(2);
    v1::BeginVersionResponse began;
    grpc::ClientContext c1;
    begin_status = fleet.daemon.versions->BeginVersion(&c1, begin, &began);
    if (begin_status.ok()) {
      v1::CommitVersionRequest commit;
      *commit.mutable_handle() = fleet.trainers[0]->handle;
      commit.set_version(2);
      v1::CommitVersionResponse out;
      grpc::ClientContext c2;
      commit_status = fleet.daemon.versions->CommitVersion(&c2, commit, &out);
    }
    rank0_done = true;
  });
  // AbortVersion(2) needs version 2 in progress: wait until the daemon
  // reports it (or rank 0's thread gave up).
  const bool in_progress = Eventually(
      [&] {
        grpc::ClientContext pc;
        v1::GetProgressRequest req;
        req.set_stream("policy");
        v1::GetProgressResponse progress;
        return rank0_done.load() ||
               (fleet.daemon.inspection->GetProgress(&pc, req, &progress).ok() &&
                progress.version() == 2);
      },
      absl::Seconds(10), absl::Milliseconds(5));
  grpc::ClientContext c3;
  abort.set_version(2);
  *abort.mutable_handle() = fleet.trainers[1]->handle;
  s = fleet.daemon.versions->AbortVersion(&c3, abort, &resp);
  rank0.join();
  INFO("rank 0 BeginVersion(2): " << begin_status.error_message());
  REQUIRE(begin_status.ok());
  CHECK(in_progress);
  INFO("AbortVersion(2): " << s.error_message());
  CHECK(s.ok());
  INFO("rank 0 CommitVersion(2): " << commit_status.error_message());
  CHECK(commit_status.error_code() == grpc::StatusCode::ABORTED);
  CHECK(commit_status.error_message().find("optimizer step failed") !=
        std::string::npos);
  // The next version works.
  auto next = RunVersion(fleet.daemon, fleet.sources(), 3);
  REQUIRE(next[0].first.ok());
  for (auto& e : fleet.engines) CHECK(e->Check(3) == "");
}

TEST_CASE("CommitVersion calls waiting for a version are answered when "
          "ferryd shuts down", "[daemon][version][failure]") {
  // No thread waits in CommitVersion: its answer is kept on the version
  // and given when the version settles. A version that cannot settle (a
  // rank that never acks, an ack timeout longer than the test) must still
  // answer every commit when ferryd stops, before its gRPC server does.
  DaemonOptions options;
  options.ack_timeout_ms = 600000;
  options.drain_timeout_ms = 200;
  Fleet fleet(options);
  EngineRank& stuck = *fleet.engines[4 + 2];  // r1's tp rank 2
  stuck.hang_version = 2;
  stuck.hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;
  REQUIRE(RunVersion(fleet.daemon, fleet.sources(), 1)[0].first.ok());

  std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> outcomes;
  std::thread trainer(
      [&] { outcomes = RunVersion(fleet.daemon, fleet.sources(), 2); });
  // Both commits counted: r0 commits version 2 only after every source
  // rank committed; r1 waits for its stuck rank.
  const bool r0_committed = Eventually(
      [&] {
        grpc::ClientContext c;
        v1::GetProgressRequest req;
        req.set_stream("policy");
        v1::GetProgressResponse progress;
        if (!fleet.daemon.inspection->GetProgress(&c, req, &progress).ok() ||
            progress.version() != 2) {
          return false;
        }
        for (const v1::InstanceProgress& i : progress.instances()) {
          if (i.status().instance_id() == "r0" &&
              i.status().state() == v1::INSTANCE_STATE_COMMITTED) {
            return true;
          }
        }
        return false;
      },
      absl::Seconds(20), absl::Milliseconds(5));
  fleet.daemon.server->Shutdown();
  trainer.join();  // hangs here if a commit were never answered
  CHECK(r0_committed);
  REQUIRE(outcomes.size() == 2);
  for (auto& [status, resp] : outcomes) {
    INFO(status.error_message());
    CHECK(status.error_code() == grpc::StatusCode::ABORTED);
    CHECK(status.error_message().find("ferryd is shutting down") !=
          std::string::npos);
  }
}

}  // namespace testing
}  // namespace ferry
