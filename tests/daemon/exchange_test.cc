// Exchanges between replicas (core/exchange.h, ferryd --exchange) across
// three daemons in this process: a coordinator node-a where the TP2
// trainer registers, and members node-b and node-c, each with one TP4
// replica (r0, r1) whose lm_head goes through staging (so neither relays:
// staging is not relayed between daemons). Buckets are 64 bytes, so the
// small test model makes many. Every byte is checked against the
// trainer's values; who gave what is what GetProgress reports
// (InstanceProgress.given_by) and the metrics count (route "exchange").
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/metrics/daemon_metrics.h"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

DaemonOptions Options(bool exchange) {
  DaemonOptions o;
  o.exchange = exchange;
  o.bucket_bytes = 64;
  o.relay_wait_ms = 200;
  return o;
}

struct Replicas {
  explicit Replicas(Nodes& nodes) : nodes(nodes) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(*nodes.coordinator, *trainers.back());
    }
    for (int k = 0; k < 2; ++k) {
      const std::string id = k == 0 ? "r0" : "r1";
      TestDaemon& d = *nodes.members[k];
      for (int r = 0; r < 4; ++r) {
        engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
        RegisterDestination(d, *engines.back());
        engines.back()->Run(d.versions.get());
      }
    }
  }
  ~Replicas() {
    for (auto& e : engines) e->Stop();
  }
  std::vector<EngineRank*> Ranks() {
    std::vector<EngineRank*> out;
    for (auto& e : engines) out.push_back(e.get());
    return out;
  }
  // Instance id -> (given_by, relayed_from) of version v.
  std::map<std::string, std::string> GivenBy(int64_t v) {
    const v1::GetProgressResponse progress =
        ProgressOf(*nodes.coordinator, "policy", v);
    REQUIRE(progress.instances_size() > 0);
    CHECK(progress.bytes_moved() == progress.bytes_total());
    std::map<std::string, std::string> out;
    for (const v1::InstanceProgress& i : progress.instances()) {
      CHECK(i.relayed_from() == "");
      out[i.status().instance_id()] = i.given_by();
    }
    return out;
  }

  Nodes& nodes;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

double Moved(TestDaemon& d, const std::string& route) {
  return d.server->metrics()->bytes_moved->Value({"policy", "remote", route, "dense"});
}

}  // namespace

TEST_CASE("replicas on two members exchange the trainer's buckets",
          "[daemon][exchange][nodes]") {
  Nodes nodes(2, Options(true));
  Replicas replicas(nodes);
  for (int64_t v = 1; v <= 2; ++v) {
    ExpectVersionCommits(*nodes.coordinator,
                         {replicas.trainers[0].get(),
                          replicas.trainers[1].get()},
                         replicas.Ranks(), v, 2);
    const std::map<std::string, std::string> given = replicas.GivenBy(v);
    CHECK(given.at("r0") == "r1");
    CHECK(given.at("r1") == "r0");
  }
  // ExplainPlan names the partner and what it gives.
  for (const char* id : {"r0", "r1"}) {
    grpc::ClientContext ctx;
    v1::ExplainPlanRequest req;
    req.set_instance_id(id);
    v1::ExplainPlanResponse plan;
    REQUIRE(nodes.coordinator->inspection->ExplainPlan(&ctx, req, &plan).ok());
    CHECK(plan.exchange_partner() == (std::string(id) == "r0" ? "r1" : "r0"));
    CHECK(plan.exchanged_bytes() > 0);
    CHECK(plan.exchanged_bytes() < plan.totals().total_bytes());
  }
  // Each replica took part of its bytes from the other; all of them
  // landed (the totals match two replicas of two versions).
  const double source = Moved(*nodes.coordinator, "source");
  const double exchange = Moved(*nodes.coordinator, "exchange");
  CHECK(exchange > 0);
  CHECK(source > exchange / 4);
  Nodes plain(2, Options(false));
  Replicas again(plain);
  ExpectVersionCommits(*plain.coordinator,
                       {again.trainers[0].get(), again.trainers[1].get()},
                       again.Ranks(), 1, 2);
  const std::map<std::string, std::string> none = again.GivenBy(1);
  CHECK(none.at("r0") == "");
  CHECK(none.at("r1") == "");
  CHECK(Moved(*plain.coordinator, "exchange") == 0);
  // The same bytes, routed otherwise: one version here, two above.
  CHECK(Moved(*plain.coordinator, "source") * 2 == source + exchange);
}

TEST_CASE("a replica whose partner cannot give its buckets reads them from "
          "the trainer", "[daemon][exchange][nodes]") {
  // r0 tp rank 0 holds PAUSE: r1 lands its first part, waits for r0 no
  // longer than relay_wait, reads the rest from the trainer and commits.
  // Then r1's memory goes away (shrunk under the daemons, as its node
  // dying would make it) and r0 is let go: its first part lands, its
  // second from r1 fails, and it reads those buckets from the trainer.
  Nodes nodes(2, Options(true));
  Replicas replicas(nodes);
  EngineRank& held = *replicas.engines[0];  // r0 tp rank 0
  held.hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;
  held.hang_version = 1;
  std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> outcome;
  std::thread version([&] {
    outcome = RunVersion(*nodes.coordinator,
                         {replicas.trainers[0].get(),
                          replicas.trainers[1].get()},
                         1);
  });
  auto state_of = [&](const std::string& id) {
    return StateOf(*nodes.coordinator, "policy", 1, id);
  };
  const bool r1_committed = Eventually(
      [&] { return state_of("r1") == v1::INSTANCE_STATE_COMMITTED; },
      absl::Seconds(10), absl::Milliseconds(10));
  for (size_t e = 4; e < 8; ++e) Shrink(*replicas.engines[e]->memory);
  const bool acked =
      AckHeld(*nodes.members[0], held, v1::UPDATE_EVENT_KIND_PAUSE, 1);
  version.join();
  REQUIRE(r1_committed);
  REQUIRE(acked);
  ExpectAllCommitted(outcome);
  const std::map<std::string, std::string> given = replicas.GivenBy(1);
  CHECK(given.at("r0") == "");  // from the trainer in the end
  CHECK(given.at("r1") == "");  // r0 was not there to give
  CHECK(Moved(*nodes.coordinator, "exchange") == 0);
  for (size_t e = 0; e < 4; ++e) CHECK(replicas.engines[e]->Check(1) == "");
}

TEST_CASE("a replica aborted between the two parts of its exchange is "
          "dirty", "[daemon][exchange][nodes]") {
  // r1 tp rank 0 holds PAUSE and relay_wait is a minute: r0 lands its
  // first part, then waits for r1 to give the rest, paused, until the
  // version times out. Its buffers hold part of version 1, so its abort
  // must say dirty; r1, which never transferred, is clean.
  DaemonOptions o = Options(true);
  o.relay_wait_ms = 60000;
  o.version_timeout_ms = 2000;
  Nodes nodes(2, o);
  Replicas replicas(nodes);
  EngineRank& held = *replicas.engines[4];  // r1 tp rank 0
  held.hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;
  held.hang_version = 1;
  const auto outcome = RunVersion(
      *nodes.coordinator,
      {replicas.trainers[0].get(), replicas.trainers[1].get()}, 1);
  std::map<std::string, v1::InstanceStatus> by_id;
  for (const auto& [status, resp] : outcome) {
    INFO(status.error_message());
    REQUIRE(status.ok());
    for (const v1::InstanceStatus& s : resp.instances()) {
      by_id[s.instance_id()] = s;
    }
  }
  REQUIRE(by_id.count("r0") == 1);
  REQUIRE(by_id.count("r1") == 1);
  INFO(by_id["r0"].DebugString());
  CHECK(by_id["r0"].state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(by_id["r0"].dirty());
  CHECK(by_id["r1"].state() == v1::INSTANCE_STATE_ABORTED);
  CHECK_FALSE(by_id["r1"].dirty());
}

}  // namespace testing
}  // namespace ferry
