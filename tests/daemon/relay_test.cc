// Replica relays (core/plan.h: the trainer sends each unique byte once,
// replicas pass it on) on one node and between nodes, in process: a
// coordinator node-a and a member node-b, real gRPC, real shared memory.
// Two TP4 replicas r0 and r1 of one layout; r1 relays from r0 when r0's
// transfer landed. Every byte is checked against the trainer's values; the
// relay is what GetProgress reports (InstanceProgress.relayed_from).
#include <chrono>
#include <map>
#include <memory>
#include <thread>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"

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
}

TEST_CASE("replicas relay between nodes and on a member",
          "[daemon][relay][nodes]") {
  TwoNodes nodes;
  SECTION("both replicas on the member, trainer on the coordinator") {
    Replicas replicas({&nodes.a, &nodes.b, &nodes.b}, true);
    CHECK(Relays(replicas.Run(1)) == kR1FromR0);
    CHECK(Relays(replicas.Run(2)) == kR1FromR0);
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
}

}  // namespace testing
}  // namespace ferry
