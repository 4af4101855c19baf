// Lifecycle.Offload and Onload (daemon/versions/offloads.cc, docs/api.md "Offload
// and onload"): an instance's ranks release their memory and come back,
// refilled from the daemon's host copy, from a peer instance, or by the
// stream's next version. In process, real gRPC, real shared memory: the
// engine ranks drop their regions on OFFLOAD and register new ones on
// ONLOAD (Registry.UpdateRegions); every byte is checked against the test
// model's values of the version (ValueAt), and the trainer's memory is
// overwritten first, so a byte read from it would show.
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

// A TP2 trainer with versions 1..3 committed on the instances asked for
// (TP2, every byte direct), then the trainer's memory set to version 99.
struct Fleet {
  explicit Fleet(std::vector<std::string> ids) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(d, *trainers.back());
    }
    for (const std::string& id : ids) {
      for (int r = 0; r < 2; ++r) {
        engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
        EngineRank& e = *engines.back();
        e.tp_size = 2;
        e.lm_head_direct = true;
        e.registry = d.registry.get();
        RegisterDestination(d, e);
        e.Run(d.versions.get());
      }
    }
    for (int64_t v = 1; v <= 3; ++v) {
      ExpectVersionCommits(d, Trainers(), Ranks(), v,
                           static_cast<int>(ids.size()));
    }
    for (auto& t : trainers) t->Fill(99);
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }
  std::vector<TrainerRank*> Trainers() {
    return {trainers[0].get(), trainers[1].get()};
  }
  std::vector<EngineRank*> Ranks(const std::string& id = "") {
    std::vector<EngineRank*> out;
    for (auto& e : engines) {
      if (id.empty() || e->instance == id) out.push_back(e.get());
    }
    return out;
  }

  TestDaemon d;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

grpc::Status Offload(TestDaemon& d, const std::string& id, bool keep,
                     v1::InstanceStatus* status) {
  grpc::ClientContext ctx;
  v1::OffloadRequest req;
  req.set_instance_id(id);
  req.set_keep_host_copy(keep);
  v1::OffloadResponse resp;
  grpc::Status s = d.lifecycle->Offload(&ctx, req, &resp);
  *status = resp.status();
  return s;
}

grpc::Status Onload(TestDaemon& d, const std::string& id,
                    v1::InstanceStatus* status) {
  grpc::ClientContext ctx;
  v1::OnloadRequest req;
  req.set_instance_id(id);
  v1::OnloadResponse resp;
  grpc::Status s = d.lifecycle->Onload(&ctx, req, &resp);
  *status = resp.status();
  return s;
}

v1::StreamInfo StreamOf(TestDaemon& d) {
  grpc::ClientContext ctx;
  v1::ListStreamsRequest req;
  req.set_stream("policy");
  v1::ListStreamsResponse resp;
  REQUIRE(d.inspection->ListStreams(&ctx, req, &resp).ok());
  REQUIRE(resp.streams_size() == 1);
  return resp.streams(0);
}

v1::InstanceInfo InstanceOf(TestDaemon& d, const std::string& id) {
  const v1::StreamInfo stream = StreamOf(d);
  for (const v1::InstanceInfo& i : stream.instances()) {
    if (i.instance_id() == id) return i;
  }
  FAIL("instance " << id << " not listed");
  return v1::InstanceInfo();
}

void ExpectOffloaded(Fleet& f, const std::string& id, int64_t copy_bytes) {
  v1::InstanceStatus st;
  const grpc::Status s = Offload(f.d, id, copy_bytes > 0, &st);
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  REQUIRE(st.state() == v1::INSTANCE_STATE_OFFLOADED);
  CHECK(st.committed_version() == 3);
  for (EngineRank* e : f.Ranks(id)) {
    CHECK(e->offloaded.load());
    CHECK(e->Check(3) != "");  // it holds no memory
  }
  const v1::InstanceInfo info = InstanceOf(f.d, id);
  CHECK(info.status().state() == v1::INSTANCE_STATE_OFFLOADED);
  CHECK(info.host_copy_bytes() == copy_bytes);
  CHECK(info.host_copy_version() == (copy_bytes > 0 ? 3 : 0));
}

// The rank deregisters and stops following its events.
void Leave(TestDaemon& d, EngineRank& e) {
  grpc::ClientContext ctx;
  v1::DeregisterRequest req;
  *req.mutable_handle() = e.handle;
  v1::DeregisterResponse resp;
  REQUIRE(d.registry->Deregister(&ctx, req, &resp).ok());
  e.Stop();
}

constexpr int64_t kRankRegionBytes = 4096;  // EngineRank's one region

TEST_CASE("Offload with a host copy, then Onload restores it from the copy: "
          "no trainer, no peer") {
  Fleet f({"a"});
  ExpectOffloaded(f, "a", 2 * kRankRegionBytes);
  v1::InstanceStatus st;
  const grpc::Status s = Onload(f.d, "a", &st);
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st.committed_version() == 3);
  CHECK_FALSE(st.dirty());
  for (EngineRank* e : f.Ranks("a")) {
    CHECK_FALSE(e->offloaded.load());
    CHECK(e->onloads.load() == 1);
    CHECK(e->Check(3) == "");  // in its new memory
  }
  const v1::StreamInfo info = StreamOf(f.d);
  CHECK(info.delivery().kind() == "onload");
  CHECK(info.delivery().peer_instance_id().empty());
  CHECK(info.delivery().bytes_moved() == 2 * kRankRegionBytes);
  CHECK(InstanceOf(f.d, "a").host_copy_bytes() == 0);  // dropped
  // The next version lands in the new memory.
  ExpectVersionCommits(f.d, f.Trainers(), f.Ranks(), 4, 1);
}

TEST_CASE("Versions published while offloaded report it OFFLOADED; Onload "
          "then refills from a peer, the host copy being stale") {
  Fleet f({"a", "b"});
  ExpectOffloaded(f, "b", 2 * kRankRegionBytes);
  for (int64_t v = 4; v <= 5; ++v) {
    std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> out =
        RunVersion(f.d, f.Trainers(), v);
    for (const auto& [s, resp] : out) {
      INFO(s.error_message());
      REQUIRE(s.ok());
      REQUIRE(resp.instances_size() == 2);
      CHECK(resp.instances(0).instance_id() == "a");
      CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_COMMITTED);
      CHECK(resp.instances(1).instance_id() == "b");
      CHECK(resp.instances(1).state() == v1::INSTANCE_STATE_OFFLOADED);
      CHECK(resp.instances(1).committed_version() == 3);
    }
    for (EngineRank* e : f.Ranks("a")) {
      CHECK(Eventually([&] { return e->Check(v) == ""; }, absl::Seconds(5)));
    }
  }
  for (auto& t : f.trainers) t->Fill(99);
  v1::InstanceStatus st;
  const grpc::Status s = Onload(f.d, "b", &st);
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st.committed_version() == 5);
  for (EngineRank* e : f.Ranks("b")) CHECK(e->Check(5) == "");
  const v1::StreamInfo info = StreamOf(f.d);
  CHECK(info.delivery().kind() == "onload");
  CHECK(info.delivery().peer_instance_id() == "a");
  for (EngineRank* e : f.Ranks("a")) CHECK(e->Check(5) == "");
  ExpectVersionCommits(f.d, f.Trainers(), f.Ranks(), 6, 2);
}

TEST_CASE("Offload without a host copy, and no peer: Onload leaves the "
          "instance dirty until the next version fills it") {
  Fleet f({"a"});
  ExpectOffloaded(f, "a", 0);
  v1::InstanceStatus st;
  const grpc::Status s = Onload(f.d, "a", &st);
  INFO(s.error_message());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(st.dirty());
  CHECK_THAT(st.abort_reason(),
             Catch::Contains("no host copy was kept") &&
                 Catch::Contains("filled by the stream's next version"));
  for (EngineRank* e : f.Ranks("a")) {
    CHECK(e->onloads.load() == 1);  // it has memory again, not weights
    CHECK(e->Check(3) != "");
  }
  ExpectVersionCommits(f.d, f.Trainers(), f.Ranks(), 4, 1);
}

TEST_CASE("Offload and Onload refuse what they cannot do, and change "
          "nothing") {
  Fleet f({"a"});
  v1::InstanceStatus st;
  CHECK(Offload(f.d, "nope", true, &st).error_code() ==
        grpc::StatusCode::NOT_FOUND);
  grpc::Status s = Onload(f.d, "a", &st);
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(s.error_message(), Catch::Contains("not offloaded"));
  // UpdateRegions is for offloaded ranks only.
  {
    EngineRank& e = *f.Ranks("a")[0];
    grpc::ClientContext ctx;
    v1::UpdateRegionsRequest req;
    *req.mutable_handle() = e.handle;
    *req.add_regions() = e.Registration().destination().regions(0);
    v1::UpdateRegionsResponse resp;
    s = f.d.registry->UpdateRegions(&ctx, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(s.error_message(), Catch::Contains("not offloaded"));
  }
  ExpectOffloaded(f, "a", 2 * kRankRegionBytes);
  s = Offload(f.d, "a", false, &st);
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK_THAT(s.error_message(), Catch::Contains("already offloaded"));
  {
    grpc::ClientContext ctx;
    v1::ReloadInPlaceRequest req;
    req.set_instance_id("a");
    v1::ReloadInPlaceResponse resp;
    s = f.d.lifecycle->ReloadInPlace(&ctx, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK_THAT(s.error_message(), Catch::Contains("offloaded"));
  }
  {
    // While offloaded: a region of another size, or one never registered.
    EngineRank& e = *f.Ranks("a")[0];
    auto fresh = SharedMemoryRegion::Create("offload-test-wrong", 8192);
    REQUIRE(fresh.ok());
    v1::UpdateRegionsRequest req;
    *req.mutable_handle() = e.handle;
    v1::MemoryRegion* r = req.add_regions();
    r->set_region_id(0);
    r->set_size_bytes(8192);
    r->mutable_shared_memory()->set_shm_name(fresh->name());
    v1::UpdateRegionsResponse resp;
    grpc::ClientContext ctx;
    s = f.d.registry->UpdateRegions(&ctx, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK_THAT(s.error_message(), Catch::Contains("region 0") &&
                                      Catch::Contains("size_bytes 8192"));
    r->set_region_id(7);
    grpc::ClientContext ctx2;
    s = f.d.registry->UpdateRegions(&ctx2, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK_THAT(s.error_message(), Catch::Contains("region 7"));
  }
  // Still offloaded, and the host copy still restores it.
  s = Onload(f.d, "a", &st);
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_COMMITTED);
  for (EngineRank* e : f.Ranks("a")) CHECK(e->Check(3) == "");
}

TEST_CASE("A rank that refuses PAUSE aborts the offload clean: nothing is "
          "released and the instance serves on") {
  Fleet f({"a"});
  EngineRank& refuses = *f.Ranks("a")[1];
  refuses.fail_version = 3;
  refuses.fail_kind = v1::UPDATE_EVENT_KIND_PAUSE;
  v1::InstanceStatus st;
  const grpc::Status s = Offload(f.d, "a", true, &st);
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_ABORTED);
  CHECK_FALSE(st.dirty());
  CHECK_THAT(st.abort_reason(), Catch::Contains("tp rank 1 failed "));
  for (EngineRank* e : f.Ranks("a")) {
    CHECK_FALSE(e->offloaded.load());
    CHECK(e->Check(3) == "");
  }
  CHECK(InstanceOf(f.d, "a").host_copy_bytes() == 0);
  ExpectVersionCommits(f.d, f.Trainers(), f.Ranks(), 4, 1);
}

TEST_CASE("A rank that acks ONLOAD without registering new memory aborts "
          "the onload, dirty") {
  Fleet f({"a"});
  ExpectOffloaded(f, "a", 2 * kRankRegionBytes);
  f.Ranks("a")[1]->registry = nullptr;  // acks, registers nothing
  v1::InstanceStatus st;
  const grpc::Status s = Onload(f.d, "a", &st);
  INFO(s.error_message());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(st.dirty());
  CHECK_THAT(st.abort_reason(),
             Catch::Contains("tp rank 1 acked ONLOAD without registering its "
                             "regions again"));
}

TEST_CASE("A rank lost during Onload leaves the instance ABORTED and dirty; "
          "it recovers at the next version") {
  Fleet f({"a"});
  ExpectOffloaded(f, "a", 2 * kRankRegionBytes);
  EngineRank& stuck = *f.Ranks("a")[1];
  stuck.hang_version = 3;
  stuck.hang_kind = v1::UPDATE_EVENT_KIND_ONLOAD;
  v1::InstanceStatus st;
  grpc::Status s;
  std::thread onload([&] { s = Onload(f.d, "a", &st); });
  // Rank 0 has allocated again; rank 1 dies before it answers.
  REQUIRE(Eventually([&] { return f.Ranks("a")[0]->onloads.load() == 1; },
                     absl::Seconds(5)));
  Leave(f.d, stuck);
  onload.join();
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(st.dirty());
  CHECK_THAT(st.abort_reason(), Catch::Contains("tp rank 1 lost"));
  // The rank comes back (a restarted process, base weights) and the next
  // version fills the whole instance.
  f.engines.push_back(std::make_unique<EngineRank>("a", 1, "policy"));
  EngineRank& back = *f.engines.back();
  back.tp_size = 2;
  back.lm_head_direct = true;
  back.registry = f.d.registry.get();
  RegisterDestination(f.d, back);
  back.Run(f.d.versions.get());
  ExpectVersionCommits(f.d, f.Trainers(), {f.Ranks("a")[0], &back}, 4, 1);
}

TEST_CASE("An instance on a member's node: its member keeps the host copy "
          "and releases the memory; onload restores it there") {
  TwoNodes nodes;
  TestDaemon& coordinator = nodes.a;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    RegisterSource(coordinator, *trainers.back());
  }
  std::vector<TrainerRank*> t = {trainers[0].get(), trainers[1].get()};
  std::vector<std::unique_ptr<EngineRank>> engines;
  std::vector<EngineRank*> m;
  for (int r = 0; r < 2; ++r) {
    engines.push_back(std::make_unique<EngineRank>("m", r, "policy"));
    EngineRank& e = *engines.back();
    e.tp_size = 2;
    e.lm_head_direct = true;
    e.registry = nodes.b.registry.get();  // the member's forwarding service
    RegisterDestination(nodes.b, e);
    e.Run(nodes.b.versions.get());
    m.push_back(&e);
  }
  ExpectVersionCommits(coordinator, t, m, 1, 1);
  for (auto& tr : trainers) tr->Fill(99);

  v1::InstanceStatus st;
  grpc::Status s = Offload(coordinator, "m", true, &st);
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  REQUIRE(st.state() == v1::INSTANCE_STATE_OFFLOADED);
  for (EngineRank* e : m) CHECK(e->offloaded.load());
  CHECK(InstanceOf(coordinator, "m").host_copy_bytes() ==
        2 * kRankRegionBytes);
  s = Onload(coordinator, "m", &st);
  INFO(s.error_message() << " / " << st.abort_reason());
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st.committed_version() == 1);
  for (EngineRank* e : m) CHECK(e->Check(1) == "");  // restored on node-b
  ExpectVersionCommits(coordinator, t, m, 2, 1);

  // Without a copy: a version goes by, the onload is dirty, the next fills.
  s = Offload(coordinator, "m", false, &st);
  REQUIRE(s.ok());
  REQUIRE(st.state() == v1::INSTANCE_STATE_OFFLOADED);
  for (const auto& [status, resp] : RunVersion(coordinator, t, 3)) {
    REQUIRE(status.ok());
    REQUIRE(resp.instances_size() == 1);
    CHECK(resp.instances(0).state() == v1::INSTANCE_STATE_OFFLOADED);
  }
  s = Onload(coordinator, "m", &st);
  REQUIRE(s.ok());
  CHECK(st.state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(st.dirty());
  ExpectVersionCommits(coordinator, t, m, 4, 1);
  for (auto& e : engines) e->Stop();
}

}  // namespace
}  // namespace testing
}  // namespace ferry
