// Delta versions (daemon/transfer/delta_routes.h, delta_shadows.h) between
// two daemons in this process: the TP2 trainer on the coordinator node-a
// (--delta_shadow_mb set there: it sends), a TP4 instance with fused qkv
// and row-parallel down_proj on member node-b, so every bucket crosses a
// TCP channel with resharding. Each version changes a chosen fraction of
// the elements (0%, 0.1%, 5%, 50%, 100%); every engine byte is checked
// against the trainer's values of that version (the engines' own Check),
// and GetProgress says how much came as patches. Then the cases that must
// go dense: the version after a dirty abort, a late (bootstrapped)
// instance on a third daemon node-c and the re-planned stream it joins, an
// instance onloaded with no copy to fill it; and one that may be patched
// again: onloaded from its host copy of the latest version, which ferryd
// wrote back whole (checked by VerifyInstance with checksums on).
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/metrics/daemon_metrics.h"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

// The fraction of elements version v changes (v >= 2; version 1 sets all).
std::map<int64_t, double>& Densities() {
  static auto* d = new std::map<int64_t, double>();
  return *d;
}

bool Changes(int param, int64_t flat, int64_t v) {
  if (v <= 1) return true;
  uint64_t h = (uint64_t(param) * 1000003u + uint64_t(flat)) * 0x9E3779B97F4A7C15ull ^
               uint64_t(v) * 0xC2B2AE3D27D4EB4Full;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return static_cast<double>(h % 1000000) / 1e6 < Densities()[v];
}

// The last version at or before v that changed the element.
float Value(int param, int64_t flat, int64_t v) {
  int64_t w = v;
  while (w > 1 && !Changes(param, flat, w)) --w;
  return static_cast<float>(w * 100000 + param * 1000 + flat);
}

DaemonOptions Options() {
  DaemonOptions o;
  o.bucket_bytes = 256;  // several buckets out of the small model
  o.relay_wait_ms = 200;
  o.delta_shadow_bytes = int64_t{1} << 20;
  return o;
}

struct Fleet {
  explicit Fleet(Nodes& nodes) : nodes(nodes) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(*nodes.coordinator, *trainers.back());
    }
    AddInstance("e", 0);
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }
  void AddInstance(const std::string& id, size_t member) {
    TestDaemon& d = *nodes.members[member];
    for (int r = 0; r < 4; ++r) {
      engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
      engines.back()->lm_head_direct = true;
      engines.back()->registry = d.registry.get();  // onload registers
      RegisterDestination(d, *engines.back());
      engines.back()->Run(d.versions.get());
    }
  }
  std::vector<TrainerRank*> Trainers() {
    return {trainers[0].get(), trainers[1].get()};
  }
  std::vector<EngineRank*> Ranks() {
    std::vector<EngineRank*> out;
    for (auto& e : engines) out.push_back(e.get());
    return out;
  }
  // Version v at `density`, every byte checked; its progress by instance.
  std::map<std::string, v1::InstanceProgress> Publish(int64_t v,
                                                      double density,
                                                      int instances) {
    Densities()[v] = density;
    ExpectVersionCommits(*nodes.coordinator, Trainers(), Ranks(), v,
                         instances);
    std::map<std::string, v1::InstanceProgress> out;
    const v1::GetProgressResponse progress =
        ProgressOf(*nodes.coordinator, "policy", v);
    for (const v1::InstanceProgress& i : progress.instances()) {
      out[i.status().instance_id()] = i;
    }
    return out;
  }

  Nodes& nodes;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

struct ValueScope {
  ValueScope() { SetValueFunction(Value); }
  ~ValueScope() {
    SetValueFunction(nullptr);
    Densities().clear();
  }
};

}  // namespace

TEST_CASE("delta versions: patches at every density, exact, TP resharded "
          "across two daemons", "[daemon][delta][nodes]") {
  ValueScope values;
  Nodes nodes(1, Options());
  Fleet fleet(nodes);
  // Version 1: no version to patch against.
  v1::InstanceProgress p = fleet.Publish(1, 1.0, 1).at("e");
  CHECK(p.patched_bytes() == 0);
  CHECK(p.bytes_moved() > 0);
  const int64_t total = p.bytes_moved();
  // Nothing changed: every bucket is a patch of no chunk.
  p = fleet.Publish(2, 0.0, 1).at("e");
  INFO(p.DebugString());
  CHECK(p.patched_bytes() == total);
  CHECK(p.changed_bytes() == 0);
  CHECK(p.patch_bytes() < total / 4);
  // A few: patches carry what changed (each changed f32 is two chunks).
  for (auto [v, density] : {std::pair<int64_t, double>{3, 0.001}, {4, 0.05}}) {
    p = fleet.Publish(v, density, 1).at("e");
    INFO("version " << v << ": " << p.DebugString());
    CHECK(p.patched_bytes() > total / 2);
    CHECK(p.changed_bytes() < p.patched_bytes() / 4);
    CHECK(p.patch_bytes() < p.patched_bytes() / 2);
  }
  // Half and all: whatever pays, and still exact.
  p = fleet.Publish(5, 0.5, 1).at("e");
  CHECK(p.patched_bytes() <= total);
  p = fleet.Publish(6, 1.0, 1).at("e");
  CHECK(p.patched_bytes() == 0);  // a patch would be larger: dense
  // The metrics split what came how (the coordinator counts).
  DaemonMetrics& m = *nodes.coordinator->server->metrics();
  CHECK(m.bytes_moved->Value({"policy", "remote", "source", "patch"}) > 0);
  CHECK(m.bytes_moved->Value({"policy", "remote", "source", "dense"}) >=
        2 * total);
  CHECK(m.patch_bytes->Value({"policy", "wire"}) > 0);
  CHECK(m.patch_bytes->Value({"policy", "changed"}) > 0);
}

TEST_CASE("delta versions: after a dirty abort, a late instance and a "
          "re-planned stream, every byte goes dense once, then patches",
          "[daemon][delta][nodes]") {
  ValueScope values;
  Nodes nodes(2, Options());
  Fleet fleet(nodes);
  fleet.Publish(1, 1.0, 1);
  CHECK(fleet.Publish(2, 0.05, 1).at("e").patched_bytes() > 0);
  // Version 3 fails at APPLY on one rank: written, not committed: dirty.
  EngineRank& failing = *fleet.engines[1];
  failing.fail_kind = v1::UPDATE_EVENT_KIND_APPLY;
  failing.fail_version = 3;
  Densities()[3] = 0.05;
  for (auto& [status, resp] : RunVersion(*nodes.coordinator, fleet.Trainers(), 3)) {
    REQUIRE(status.ok());
    REQUIRE(resp.instances_size() == 1);
    CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_ABORTED);
    CHECK(resp.instances(0).dirty());
    CHECK(resp.instances(0).patch_base() == 0);
  }
  // Version 4: dense (its memory holds part of 3), exact.
  v1::InstanceProgress p = fleet.Publish(4, 0.05, 1).at("e");
  CHECK(p.patched_bytes() == 0);
  CHECK(p.status().patch_base() == 4);
  CHECK(fleet.Publish(5, 0.05, 1).at("e").patched_bytes() > 0);
  // A late instance on node-c: bootstrapped from "e" at version 5, then
  // version 6 re-planned for two instances: both dense.
  fleet.AddInstance("late", 1);
  for (size_t r = 4; r < 8; ++r) {
    EngineRank& e = *fleet.engines[r];
    REQUIRE(Eventually([&] {
      std::lock_guard<std::mutex> lock(e.mu);
      return e.committed == 5;
    }, absl::Seconds(20)));
  }
  std::map<std::string, v1::InstanceProgress> both = fleet.Publish(6, 0.05, 2);
  CHECK(both.at("e").patched_bytes() == 0);
  CHECK(both.at("late").patched_bytes() == 0);
  both = fleet.Publish(7, 0.05, 2);
  CHECK(both.at("e").patched_bytes() > 0);
  CHECK(both.at("late").patched_bytes() > 0);
}

TEST_CASE("delta versions: an instance offloaded and onloaded; patches "
          "checked by ferryctl verify", "[daemon][delta][nodes]") {
  ValueScope values;
  DaemonOptions o = Options();
  o.transfer_checksums = true;
  Nodes nodes(1, o);
  Fleet fleet(nodes);
  fleet.Publish(1, 1.0, 1);
  fleet.Publish(2, 0.05, 1);
  // Offloaded with a host copy of version 2 and onloaded from it: ferryd
  // wrote every byte of 2 back, so version 3 may be patched, and is exact.
  auto lifecycle = [&](bool offload, bool keep) {
    grpc::ClientContext ctx;
    if (offload) {
      v1::OffloadRequest req;
      req.set_instance_id("e");
      req.set_keep_host_copy(keep);
      v1::OffloadResponse resp;
      REQUIRE(nodes.coordinator->lifecycle->Offload(&ctx, req, &resp).ok());
      return resp.status();
    }
    v1::OnloadRequest req;
    req.set_instance_id("e");
    v1::OnloadResponse resp;
    REQUIRE(nodes.coordinator->lifecycle->Onload(&ctx, req, &resp).ok());
    return resp.status();
  };
  CHECK(lifecycle(true, true).state() == v1::INSTANCE_STATE_OFFLOADED);
  v1::InstanceStatus st = lifecycle(false, false);
  CHECK(st.state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st.patch_base() == 2);
  v1::InstanceProgress p = fleet.Publish(3, 0.05, 1).at("e");
  CHECK(p.patched_bytes() > 0);
  // The result, not the patch, is what verify compares.
  grpc::ClientContext ctx;
  v1::VerifyInstanceRequest req;
  req.set_instance_id("e");
  v1::VerifyInstanceResponse r;
  REQUIRE(nodes.coordinator->inspection->VerifyInstance(&ctx, req, &r).ok());
  CHECK(r.version() == 3);
  CHECK(r.bytes_checked() > 0);
  CHECK(r.mismatches_size() == 0);
  // Offloaded (host copy of 3) while version 4 went by: it was the only
  // instance, so 4 committed nowhere and the latest is still 3. Onload
  // writes 3 back from the copy, whole; the shadows, not read in 4, are
  // still at 3: version 5 is patched from 3, and exact.
  CHECK(lifecycle(true, true).state() == v1::INSTANCE_STATE_OFFLOADED);
  Densities()[4] = 0.05;
  for (auto& [status, resp] : RunVersion(*nodes.coordinator, fleet.Trainers(), 4)) {
    REQUIRE(status.ok());
    CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_OFFLOADED);
  }
  st = lifecycle(false, false);
  CHECK(st.state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st.patch_base() == 3);
  CHECK(fleet.Publish(5, 0.05, 1).at("e").patched_bytes() > 0);
  // Offloaded without a copy: onload finds none (and no peer): aborted,
  // dirty, nothing to patch from; version 6 goes dense, exact; 7 patches.
  CHECK(lifecycle(true, false).state() == v1::INSTANCE_STATE_OFFLOADED);
  st = lifecycle(false, false);
  CHECK(st.state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(st.dirty());
  CHECK(st.patch_base() == 0);
  CHECK(fleet.Publish(6, 0.05, 1).at("e").patched_bytes() == 0);
  CHECK(fleet.Publish(7, 0.05, 1).at("e").patched_bytes() > 0);
}

}  // namespace testing
}  // namespace ferry
