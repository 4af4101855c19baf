// Replica relays (core/plan.h: the trainer sends each unique byte once,
// replicas pass it on) on one node and between nodes, in process: a
// coordinator node-a and a member node-b, real gRPC, real shared memory.
// Two TP4 replicas r0 and r1 of one layout; r1 relays from r0 when r0's
// transfer landed. Every byte is checked against the trainer's values; the
// relay is what GetProgress reports (InstanceProgress.relayed_from).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <map>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/metrics/daemon_metrics.h"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

struct Placement {
  TestDaemon* trainers;  // where the TP2 trainer registers
  TestDaemon* r0;        // where replica r0's ranks register
  TestDaemon* r1;
};

struct Replicas {
  Replicas(const Placement& at, bool lm_head_direct) : at(at) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(*at.trainers, *trainers.back());
    }
    for (const char* id : {"r0", "r1"}) {
      TestDaemon& d = std::string(id) == "r0" ? *at.r0 : *at.r1;
      for (int r = 0; r < 4; ++r) {
        engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
        engines.back()->lm_head_direct = lm_head_direct;
        RegisterDestination(d, *engines.back());
        engines.back()->Run(d.versions.get());
      }
    }
  }
  ~Replicas() {
    for (auto& e : engines) e->Stop();
  }

  // Runs version v; both replicas commit with every byte right. Returns
  // instance id -> the replica it relayed from ("" for none).
  std::map<std::string, std::string> Run(int64_t v) {
    std::vector<EngineRank*> ranks;
    for (auto& e : engines) ranks.push_back(e.get());
    ExpectVersionCommits(*at.trainers, {trainers[0].get(), trainers[1].get()},
                         ranks, v, 2);
    grpc::ClientContext ctx;
    v1::GetProgressRequest req;
    req.set_stream("policy");
    req.set_version(v);
    v1::GetProgressResponse progress;
    REQUIRE(at.trainers->inspection->GetProgress(&ctx, req, &progress).ok());
    CHECK(progress.bytes_moved() == progress.bytes_total());
    std::map<std::string, std::string> relayed;
    for (const v1::InstanceProgress& i : progress.instances()) {
      relayed[i.status().instance_id()] = i.relayed_from();
    }
    return relayed;
  }

  Placement at;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

// "r0<- r1<-r0": who relayed from whom, printable in a failed CHECK.
std::string Relays(const std::map<std::string, std::string>& relayed) {
  std::string out;
  for (const auto& [id, from] : relayed) out += id + "<-" + from + " ";
  return out;
}
const char kR1FromR0[] = "r0<- r1<-r0 ";

}  // namespace

TEST_CASE("replicas on one node relay, with or without fallback tensors",
          "[daemon][relay]") {
  TestDaemon daemon;
  const bool direct = GENERATE(true, false);
  INFO((direct ? "every byte direct" : "lm_head through staging"));
  Replicas replicas({&daemon, &daemon, &daemon}, direct);
  CHECK(Relays(replicas.Run(1)) == kR1FromR0);
  CHECK(Relays(replicas.Run(2)) == kR1FromR0);
  // The metrics tell the routes apart: r0 from the trainer, r1 relayed,
  // the same bytes each (one replica's worth per version), all local.
  const DaemonMetrics& m = *daemon.server->metrics();
  const double source = m.bytes_moved->Value({"policy", "local", "source", "dense"});
  CHECK(source > 0);
  CHECK(m.bytes_moved->Value({"policy", "local", "relay", "dense"}) == source);
  CHECK(m.bytes_moved->Value({"policy", "remote", "source", "dense"}) == 0);
  CHECK(m.instance_versions->Value({"policy", "r1", "committed", "none"}) == 2);
  CHECK(m.committed_version->Value({"policy", "r1"}) == 2);
}

TEST_CASE("replicas relay between nodes and on a member",
          "[daemon][relay][nodes]") {
  TwoNodes nodes;
  SECTION("both replicas on the member, trainer on the coordinator") {
    Replicas replicas({&nodes.a, &nodes.b, &nodes.b}, true);
    CHECK(Relays(replicas.Run(1)) == kR1FromR0);
    CHECK(Relays(replicas.Run(2)) == kR1FromR0);
    // Counted by the coordinator, which runs the protocol: both replicas
    // were filled through the member; the coordinator opened one TCP
    // channel to it and kept it (no reconnect).
    const DaemonMetrics& m = *nodes.a.server->metrics();
    CHECK(m.bytes_moved->Value({"policy", "remote", "source", "dense"}) > 0);
    CHECK(m.bytes_moved->Value({"policy", "local", "source", "dense"}) == 0);
    CHECK(m.channel_opens->Value({"tcp", "first"}) == 1);
    CHECK(m.channel_opens->Value({"tcp", "reconnect"}) == 0);
  }
  SECTION("r0 on the member, r1 on the coordinator (the member sends)") {
    Replicas replicas({&nodes.a, &nodes.b, &nodes.a}, true);
    CHECK(Relays(replicas.Run(1)) == kR1FromR0);
    CHECK(Relays(replicas.Run(2)) == kR1FromR0);
  }
  SECTION("r0 on the coordinator, r1 on the member (the coordinator sends)") {
    Replicas replicas({&nodes.b, &nodes.a, &nodes.b}, true);
    CHECK(Relays(replicas.Run(1)) == kR1FromR0);
  }
}

TEST_CASE("replicas with fallback tensors on other nodes read from the "
          "trainer", "[daemon][relay][nodes]") {
  TwoNodes nodes;
  Replicas replicas({&nodes.a, &nodes.b, &nodes.a}, /*lm_head_direct=*/false);
  CHECK(Relays(replicas.Run(1)) == "r0<- r1<- ");
  // The coordinator holds staging for the ranks on its own node only (r1's
  // four, lm_head [16, 8] F32 whole each); r0's is on the member, which
  // reserves it itself. It used to reserve (and never write) both.
  DaemonMetrics& m = *nodes.a.server->metrics();
  m.Render();  // runs the collector
  CHECK(m.staging_bytes->Value({"in_use"}) == 4 * 16 * 8 * 4);
  // The member reports its own (it read 0 before).
  DaemonMetrics& member = *nodes.b.server->metrics();
  member.Render();
  CHECK(member.staging_bytes->Value({"in_use"}) == 4 * 16 * 8 * 4);
}

TEST_CASE("a replica whose relay would not run does not wait for the "
          "replica its plan names", "[daemon][relay][nodes]") {
  // r1's plan relays from r0, but r0 is on the member and r1 has fallback
  // tensors (staging is not relayed between daemons): r1 reads the
  // trainer. It used to wait for r0 all the same, up to relay_wait while
  // r0 paused (and for the whole of r0's transfer once it had), so
  // replicas spread over nodes moved one relay stage at a time. Here r0
  // holds PAUSE and relay_wait is a minute: r1 commits meanwhile.
  DaemonOptions o;
  o.relay_wait_ms = 60000;
  TwoNodes nodes(nullptr, nullptr, o);
  Replicas replicas({&nodes.a, &nodes.b, &nodes.a}, /*lm_head_direct=*/false);
  EngineRank& held = *replicas.engines[0];  // r0 tp rank 0
  held.hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;
  held.hang_version = 1;
  std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> outcome;
  std::thread version([&] {
    outcome = RunVersion(nodes.a, {replicas.trainers[0].get(),
                                   replicas.trainers[1].get()}, 1);
  });
  auto state_of = [&](const std::string& id) {
    return StateOf(nodes.a, "policy", 1, id);
  };
  // Five seconds: well before r0's lease (10 s) runs out while it hangs,
  // which would end the wait too.
  const bool r1_committed = Eventually(
      [&] { return state_of("r1") == v1::INSTANCE_STATE_COMMITTED; },
      absl::Seconds(5), absl::Milliseconds(10));
  const v1::InstanceState r0_then = state_of("r0");
  const bool acked =
      AckHeld(nodes.b, held, v1::UPDATE_EVENT_KIND_PAUSE, 1);
  version.join();
  CHECK(r1_committed);  // within 5 s, with r0 still pausing
  CHECK(r0_then != v1::INSTANCE_STATE_COMMITTED);
  REQUIRE(acked);
  ExpectAllCommitted(outcome);
  for (auto& e : replicas.engines) CHECK(e->Check(1) == "");
}

TEST_CASE("a replica whose relay fails under it is fed from the trainer "
          "and commits", "[daemon][relay]") {
  // Found by the chaos soak (FERRY_SOAK_SEED=4): a member daemon killed
  // while a replica on another node relayed from its instance aborted that
  // replica (dirty), though nothing of it had failed. Here r0's memory
  // becomes unreadable (shrunk under the daemon, as its node dying would
  // make it) after r0 committed and before r1, held in PAUSE, relays.
  TestDaemon daemon;
  Replicas replicas({&daemon, &daemon, &daemon}, /*lm_head_direct=*/true);
  EngineRank& held = *replicas.engines[4];  // r1 tp rank 0
  held.hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;
  held.hang_version = 1;
  std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> outcome;
  std::thread version([&] {
    outcome = RunVersion(daemon, {replicas.trainers[0].get(),
                                  replicas.trainers[1].get()}, 1);
  });
  auto state_of = [&](const std::string& id) {
    return StateOf(daemon, "policy", 1, id);
  };
  const bool r0_committed = Eventually(
      [&] { return state_of("r0") == v1::INSTANCE_STATE_COMMITTED; },
      absl::Seconds(5), absl::Milliseconds(10));
  // r0 tp rank 0's arena shrinks to nothing; then r1 tp rank 0 pauses.
  const int fd = shm_open(replicas.engines[0]->memory->name().c_str(), O_RDWR, 0);
  const bool shrunk = fd >= 0 && ftruncate(fd, 0) == 0;
  if (fd >= 0) close(fd);
  const bool acked =
      AckHeld(daemon, held, v1::UPDATE_EVENT_KIND_PAUSE, 1);
  version.join();
  REQUIRE(r0_committed);
  REQUIRE(shrunk);
  REQUIRE(acked);
  ExpectAllCommitted(outcome);
  grpc::ClientContext ctx;
  v1::GetProgressRequest req;
  req.set_stream("policy");
  req.set_version(1);
  v1::GetProgressResponse progress;
  REQUIRE(daemon.inspection->GetProgress(&ctx, req, &progress).ok());
  for (const v1::InstanceProgress& i : progress.instances()) {
    CHECK(i.relayed_from() == "");  // r1 read the trainer in the end
  }
  for (size_t e = 4; e < 8; ++e) CHECK(replicas.engines[e]->Check(1) == "");
}

}  // namespace testing
}  // namespace ferry
