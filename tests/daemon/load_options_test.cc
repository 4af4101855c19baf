// Lifecycle.UpdateConfig (daemon/registry/load_options.h, docs/api.md "Load
// options"): an instance's load_format and serve_as_peer, validated, kept
// by the daemon and used from the next delivery. In process, real gRPC and
// shared memory; bytes checked against the test model's values.
#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

grpc::Status Config(TestDaemon& d, const std::string& instance,
                    const std::map<std::string, std::string>& set,
                    const std::vector<std::string>& clear,
                    v1::UpdateConfigResponse* resp) {
  grpc::ClientContext ctx;
  v1::UpdateConfigRequest req;
  req.set_instance_id(instance);
  for (const auto& [k, v] : set) (*req.mutable_set_options())[k] = v;
  for (const auto& k : clear) req.add_clear_options(k);
  return d.lifecycle->UpdateConfig(&ctx, req, resp);
}

std::map<std::string, std::string> Options(const v1::UpdateConfigResponse& r) {
  return {r.options().begin(), r.options().end()};
}

// A TP2 trainer; instance "a" (TP2, every byte direct) and "b" (TP4,
// lm_head through its loader).
struct Fleet {
  Fleet() {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(d, *trainers.back());
    }
    Add("a", 2, true);
    Add("b", 4, false);
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }
  void Add(const std::string& id, int tp, bool lm_head_direct) {
    for (int r = 0; r < tp; ++r) {
      engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
      engines.back()->tp_size = tp;
      engines.back()->lm_head_direct = lm_head_direct;
      RegisterDestination(d, *engines.back());
      engines.back()->Run(d.versions.get());
    }
  }
  std::vector<EngineRank*> Of(const std::string& id) {
    std::vector<EngineRank*> out;
    for (auto& e : engines) {
      if (e->instance == id) out.push_back(e.get());
    }
    return out;
  }
  std::vector<EngineRank*> All() {
    std::vector<EngineRank*> out;
    for (auto& e : engines) out.push_back(e.get());
    return out;
  }
  void Commit(int64_t v, int instances) {
    ExpectVersionCommits(d, {trainers[0].get(), trainers[1].get()}, All(), v,
                         instances);
  }

  TestDaemon d;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

TEST_CASE("UpdateConfig returns every option, defaults included") {
  Fleet f;
  v1::UpdateConfigResponse resp;
  REQUIRE(Config(f.d, "b", {}, {}, &resp).ok());
  CHECK(Options(resp) == std::map<std::string, std::string>{
                             {"load_format", "auto"},
                             {"serve_as_peer", "true"}});
  REQUIRE(Config(f.d, "b", {{"serve_as_peer", "false"}}, {}, &resp).ok());
  CHECK(Options(resp)["serve_as_peer"] == "false");
  REQUIRE(Config(f.d, "b", {}, {}, &resp).ok());  // kept
  CHECK(Options(resp)["serve_as_peer"] == "false");
  REQUIRE(Config(f.d, "b", {}, {"serve_as_peer"}, &resp).ok());
  CHECK(Options(resp)["serve_as_peer"] == "true");
}

TEST_CASE("UpdateConfig: bad keys and values are INVALID_ARGUMENT, named") {
  Fleet f;
  v1::UpdateConfigResponse resp;
  grpc::Status s = Config(f.d, "b", {{"load_fromat", "auto"}}, {}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message() ==
        "UpdateConfig(b): option 'load_fromat' is unknown; the keys are "
        "load_format, serve_as_peer");
  s = Config(f.d, "b", {{"load_format", "safetensors"}}, {}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message() ==
        "UpdateConfig(b): option load_format: value 'safetensors' is not one "
        "of auto, direct_only, fallback_only");
  s = Config(f.d, "b", {{"serve_as_peer", "yes"}}, {}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("serve_as_peer") != std::string::npos);
  s = Config(f.d, "b", {{"load_format", "auto"}}, {"load_format"}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("both set and cleared") != std::string::npos);
  s = Config(f.d, "nobody", {}, {}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
  // Bounded before anything else: 33 keys, a 200-byte key or value.
  std::map<std::string, std::string> many;
  for (int i = 0; i < 33; ++i) many[absl::StrCat("k", i)] = "v";
  s = Config(f.d, "b", many, {}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(s.error_message().find("set_options + clear_options") != std::string::npos);
  s = Config(f.d, "b", {{std::string(200, 'k'), "auto"}}, {}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("set_options key") != std::string::npos);
  CHECK(s.error_message().find("is 200 bytes") != std::string::npos);
  s = Config(f.d, "b", {{"load_format", std::string(200, 'x')}}, {}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  s = Config(f.d, "b", {}, {std::string(200, 'c')}, &resp);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_CASE("fallback_only: the next version arrives entirely through the "
          "engine's loader, bytes identical") {
  Fleet f;
  f.Commit(1, 2);
  v1::UpdateConfigResponse resp;
  grpc::Status s =
      Config(f.d, "b", {{"load_format", "fallback_only"}}, {}, &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  CHECK(Options(resp)["load_format"] == "fallback_only");
  // Nothing moves until the next delivery: b still holds version 1.
  for (EngineRank* e : f.Of("b")) CHECK(e->Check(1) == "");
  for (EngineRank* e : f.Of("b")) {
    std::memset(e->memory->data(), 0, e->memory->size());
  }
  f.Commit(2, 2);  // checks every byte of a and b against version 2
  for (EngineRank* e : f.Of("b")) {
    std::lock_guard<std::mutex> lock(e->mu);
    std::vector<std::string> got = e->last_fallbacks;
    std::sort(got.begin(), got.end());
    std::vector<std::string> want;
    for (const TestParam& p : TestModel()) want.push_back(p.name);
    std::sort(want.begin(), want.end());
    CHECK(got == want);
  }
  grpc::ClientContext ctx;
  v1::ExplainPlanRequest explain;
  explain.set_instance_id("b");
  v1::ExplainPlanResponse plan;
  REQUIRE(f.d.inspection->ExplainPlan(&ctx, explain, &plan).ok());
  CHECK(plan.totals().direct_bytes() == 0);
  CHECK(plan.totals().fallback_bytes() == plan.totals().total_bytes());
  // Back to auto: direct again from the next version.
  REQUIRE(Config(f.d, "b", {}, {"load_format"}, &resp).ok());
  f.Commit(3, 2);
  for (EngineRank* e : f.Of("b")) {
    std::lock_guard<std::mutex> lock(e->mu);
    CHECK(e->last_fallbacks == std::vector<std::string>{"lm_head.weight"});
  }
}

TEST_CASE("direct_only is refused for a table that needs the loader, with "
          "the parameter named; accepted where every byte is direct") {
  Fleet f;
  v1::UpdateConfigResponse resp;
  grpc::Status s = Config(f.d, "b", {{"load_format", "direct_only"}}, {}, &resp);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("UpdateConfig(b): instance b: load_format "
                               "direct_only: engine parameter lm_head.weight "
                               "on tp rank 0 would need the engine's loader") ==
        0);
  REQUIRE(Config(f.d, "b", {}, {}, &resp).ok());
  CHECK(Options(resp)["load_format"] == "auto");  // unchanged

  REQUIRE(Config(f.d, "a", {{"load_format", "direct_only"}}, {}, &resp).ok());
  f.Commit(1, 2);
}

TEST_CASE("serve_as_peer false: the instance is not read for a bootstrap") {
  Fleet f;
  f.Commit(1, 2);
  v1::UpdateConfigResponse resp;
  REQUIRE(Config(f.d, "a", {{"serve_as_peer", "false"}}, {}, &resp).ok());
  f.Add("late", 2, true);
  auto waiting = [&] {
    grpc::ClientContext ctx;
    v1::ListStreamsRequest req;
    req.set_stream("policy");
    v1::ListStreamsResponse streams;
    if (!f.d.inspection->ListStreams(&ctx, req, &streams).ok()) return std::string();
    for (const auto& i : streams.streams(0).instances()) {
      if (i.instance_id() == "late") return i.status().waiting_reason();
    }
    return std::string();
  };
  REQUIRE(Eventually([&] { return !waiting().empty(); }, absl::Seconds(10)));
  INFO(waiting());
  CHECK(waiting().find("a has serve_as_peer false") != std::string::npos);
  CHECK(waiting().find("b receives lm_head.weight through its loader") !=
        std::string::npos);
  f.Commit(2, 3);
}

}  // namespace
}  // namespace testing
}  // namespace ferry
