// Peer deliveries (daemon/versions/version_coordinator.h, docs/api.md "Bootstrap and
// reload"): a late instance is bootstrapped from a live peer instance that
// holds the stream's latest committed version, and ReloadInPlace rewrites
// an instance from a peer, never from the trainer. In process, real gRPC,
// real shared memory; every byte is checked against the test model's values
// of the version (ValueAt), and the trainer's memory is overwritten first
// so that a byte read from it would show.
#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_join.h"
#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

v1::StreamInfo StreamOf(TestDaemon& d, const std::string& stream) {
  grpc::ClientContext ctx;
  v1::ListStreamsRequest req;
  req.set_stream(stream);
  v1::ListStreamsResponse resp;
  grpc::Status s = d.inspection->ListStreams(&ctx, req, &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  REQUIRE(resp.streams_size() == 1);
  return resp.streams(0);
}

v1::InstanceStatus StatusOf(TestDaemon& d, const std::string& instance) {
  const v1::StreamInfo info = StreamOf(d, "policy");
  for (const v1::InstanceInfo& i : info.instances()) {
    if (i.instance_id() == instance) return i.status();
  }
  return v1::InstanceStatus();
}

// EngineRank's log says "UPDATE_EVENT_KIND_PREPARE 3"; `line` "PREPARE 3".
bool Logged(const EngineRank& e, const std::string& line) {
  std::lock_guard<std::mutex> lock(e.mu);
  for (const std::string& l : e.log) {
    if (l == "UPDATE_EVENT_KIND_" + line) return true;
  }
  return false;
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

// A TP2 trainer and instance "a" (TP2, every byte direct: it can serve as
// a peer) with versions 1..3 committed.
struct Fleet {
  explicit Fleet(DaemonOptions options = DaemonOptions()) : d(options) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(d, *trainers.back());
    }
    a = AddInstance("a", 2, /*lm_head_direct=*/true);
    Join(a);
    for (int64_t v = 1; v <= 3; ++v) {
      ExpectVersionCommits(d, TrainerPtrs(), Ranks(), v, 1);
    }
    // The trainer has moved on: a byte read from it now would be wrong.
    for (auto& t : trainers) t->Fill(99);
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }

  std::vector<EngineRank*> AddInstance(const std::string& id, int tp,
                                       bool lm_head_direct) {
    std::vector<EngineRank*> ranks;
    for (int r = 0; r < tp; ++r) {
      engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
      EngineRank& e = *engines.back();
      e.tp_size = tp;
      e.lm_head_direct = lm_head_direct;
      ranks.push_back(&e);
    }
    return ranks;
  }
  void Join(const std::vector<EngineRank*>& ranks) {
    for (EngineRank* e : ranks) {
      RegisterDestination(d, *e);
      e->Run(d.versions.get());
    }
  }
  std::vector<TrainerRank*> TrainerPtrs() {
    return {trainers[0].get(), trainers[1].get()};
  }
  std::vector<EngineRank*> Ranks() {
    std::vector<EngineRank*> out;
    for (auto& e : engines) out.push_back(e.get());
    return out;
  }

  TestDaemon d;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
  std::vector<EngineRank*> a;
};

bool CommittedAt(TestDaemon& d, const std::string& id, int64_t v) {
  const v1::InstanceStatus s = StatusOf(d, id);
  return s.state() == v1::INSTANCE_STATE_COMMITTED &&
         s.committed_version() == v && !s.dirty();
}

TEST_CASE("A late TP4 instance with fused qkv is bootstrapped from a TP2 "
          "peer, not from the trainer") {
  Fleet f;
  std::vector<EngineRank*> b = f.AddInstance("b", 4, /*lm_head_direct=*/false);
  f.Join(b);  // held_version 0, behind version 3
  REQUIRE(Eventually([&] { return CommittedAt(f.d, "b", 3); },
                     absl::Seconds(10)));
  for (EngineRank* e : b) {
    INFO(e->instance << " tp rank " << e->tp_rank);
    CHECK(e->Check(3) == "");  // fused qkv, row shards, lm_head via staging
    for (const char* kind : {"PREPARE 3", "PAUSE 3", "APPLY 3"}) {
      CHECK(Logged(*e, kind));
    }
    CHECK(Eventually([&] { return Logged(*e, "COMMIT 3"); }, absl::Seconds(5)));
  }
  const v1::StreamInfo info = StreamOf(f.d, "policy");
  CHECK(info.delivery().kind() == "bootstrap");
  CHECK(info.delivery().instance_id() == "b");
  CHECK(info.delivery().peer_instance_id() == "a");
  CHECK(info.delivery().version() == 3);
  CHECK(info.delivery().settled());
  CHECK(info.delivery().bytes_total() > 0);
  CHECK(info.delivery().bytes_moved() == info.delivery().bytes_total());
  // The peer kept serving: still committed at 3, its bytes untouched.
  CHECK(CommittedAt(f.d, "a", 3));
  for (EngineRank* e : f.a) CHECK(e->Check(3) == "");
  // From now on b is an ordinary member of the fleet.
  ExpectVersionCommits(f.d, f.TrainerPtrs(), f.Ranks(), 4, 2);
}

// Found by the PyTorch example on a slow run: the trainer had finished and
// deregistered before the late engine registered, and the stream's plan,
// built from the sources' declarations only, left every instance without a
// model, so nothing was bootstrapped and the engine waited forever.
TEST_CASE("With the trainer gone between runs, a late instance is still "
          "bootstrapped from a peer; the trainer's next run lands on both") {
  Fleet f;
  for (auto& t : f.trainers) {
    grpc::ClientContext ctx;
    v1::DeregisterRequest req;
    *req.mutable_handle() = t->handle;
    v1::DeregisterResponse resp;
    REQUIRE(f.d.registry->Deregister(&ctx, req, &resp).ok());
  }
  std::vector<EngineRank*> b = f.AddInstance("b", 4, /*lm_head_direct=*/false);
  f.Join(b);
  REQUIRE(Eventually([&] { return CommittedAt(f.d, "b", 3); },
                     absl::Seconds(10)));
  for (EngineRank* e : b) {
    INFO(e->instance << " tp rank " << e->tp_rank);
    CHECK(e->Check(3) == "");
  }
  CHECK(StreamOf(f.d, "policy").delivery().peer_instance_id() == "a");
  // The trainer comes back (a new run) and publishes version 4 to both.
  for (auto& t : f.trainers) RegisterSource(f.d, *t);
  ExpectVersionCommits(f.d, f.TrainerPtrs(), f.Ranks(), 4, 2);
}

TEST_CASE("Bootstrap between nodes: the new instance on a member, or the "
          "peer on it") {
  for (const bool peer_on_member : {false, true}) {
    INFO((peer_on_member ? "peer on node-b" : "new instance on node-b"));
    TwoNodes nodes;
    TestDaemon& coordinator = nodes.a;
    TestDaemon& peer_node = peer_on_member ? nodes.b : nodes.a;
    TestDaemon& late_node = peer_on_member ? nodes.a : nodes.b;
    std::vector<std::unique_ptr<TrainerRank>> trainers;
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(coordinator, *trainers.back());
    }
    std::vector<std::unique_ptr<EngineRank>> engines;
    auto add = [&](TestDaemon& at, const std::string& id, int tp, bool direct) {
      std::vector<EngineRank*> out;
      for (int r = 0; r < tp; ++r) {
        engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
        engines.back()->tp_size = tp;
        engines.back()->lm_head_direct = direct;
        RegisterDestination(at, *engines.back());
        engines.back()->Run(at.versions.get());
        out.push_back(engines.back().get());
      }
      return out;
    };
    std::vector<EngineRank*> a = add(peer_node, "a", 2, true);
    std::vector<TrainerRank*> t = {trainers[0].get(), trainers[1].get()};
    ExpectVersionCommits(coordinator, t, a, 1, 1);
    ExpectVersionCommits(coordinator, t, a, 2, 1);
    for (auto& tr : trainers) tr->Fill(99);
    std::vector<EngineRank*> b = add(late_node, "b", 4, false);
    REQUIRE(Eventually([&] { return CommittedAt(coordinator, "b", 2); },
                       absl::Seconds(10)));
    for (EngineRank* e : b) CHECK(e->Check(2) == "");
    const v1::PeerDelivery d = StreamOf(coordinator, "policy").delivery();
    CHECK(d.kind() == "bootstrap");
    CHECK(d.peer_instance_id() == "a");
    CHECK(d.bytes_moved() == d.bytes_total());
    std::vector<EngineRank*> all = a;
    all.insert(all.end(), b.begin(), b.end());
    ExpectVersionCommits(coordinator, t, all, 3, 2);
    for (auto& e : engines) e->Stop();
  }
}

TEST_CASE("An instance with no peer holding the latest version waits for "
          "the next one, and its status says why") {
  Fleet f;
  // c cannot serve: its lm_head goes through its loader (staging).
  std::vector<EngineRank*> c = f.AddInstance("c", 4, /*lm_head_direct=*/false);
  f.Join(c);
  REQUIRE(Eventually([&] { return CommittedAt(f.d, "c", 3); },
                     absl::Seconds(10)));
  // Take a away: the only peer left (c) holds lm_head in staging only.
  for (EngineRank* e : f.a) Leave(f.d, *e);
  std::vector<EngineRank*> late = f.AddInstance("late", 2, true);
  f.Join(late);
  REQUIRE(Eventually([&] {
    return !StatusOf(f.d, "late").waiting_reason().empty();
  }, absl::Seconds(10)));
  const v1::InstanceStatus s = StatusOf(f.d, "late");
  INFO(s.DebugString());
  CHECK(s.state() == v1::INSTANCE_STATE_IDLE);
  CHECK(s.committed_version() == 0);
  CHECK(s.waiting_reason().find("no instance holds version 3") !=
        std::string::npos);
  CHECK(s.waiting_reason().find("c receives lm_head.weight through its "
                                "loader") != std::string::npos);
  CHECK(s.waiting_reason().find("next version") != std::string::npos);
  std::vector<EngineRank*> fleet = c;
  fleet.insert(fleet.end(), late.begin(), late.end());
  ExpectVersionCommits(f.d, f.TrainerPtrs(), fleet, 4, 2);
}

TEST_CASE("A peer rank lost mid-bootstrap aborts the bootstrap, dirty; the "
          "instance fills at the next version, the others unaffected") {
  DaemonOptions options;
  options.ack_timeout_ms = 5000;
  Fleet f(options);
  std::vector<EngineRank*> other = f.AddInstance("other", 2, true);
  f.Join(other);
  REQUIRE(Eventually([&] { return CommittedAt(f.d, "other", 3); },
                     absl::Seconds(10)));
  std::vector<EngineRank*> b = f.AddInstance("b", 4, false);
  // b holds its APPLY of version 3: its buffers are written by then.
  b[0]->hang_version = 3;
  b[0]->hang_kind = v1::UPDATE_EVENT_KIND_APPLY;
  f.Join(b);
  REQUIRE(Eventually([&] {
    const v1::StreamInfo info = StreamOf(f.d, "policy");
    return info.delivery().instance_id() == "b" &&
           info.delivery().status().state() == v1::INSTANCE_STATE_APPLY;
  }, absl::Seconds(10)));
  const std::string peer = StreamOf(f.d, "policy").delivery().peer_instance_id();
  std::vector<EngineRank*>& peer_ranks = peer == "a" ? f.a : other;
  // The peer's tp rank 1 dies (its lease is dropped, as the reaper does
  // for a process that exited).
  Leave(f.d, *peer_ranks[1]);
  REQUIRE(Eventually([&] {
    return StatusOf(f.d, "b").state() == v1::INSTANCE_STATE_ABORTED;
  }, absl::Seconds(10)));
  const v1::InstanceStatus s = StatusOf(f.d, "b");
  INFO(s.DebugString());
  CHECK(s.dirty());
  CHECK(s.abort_reason().find("peer instance " + peer + " tp rank 1 lost") !=
        std::string::npos);
  // The surviving instance (the one not read) is still committed at 3.
  const std::string survivor = peer == "a" ? "other" : "a";
  CHECK(CommittedAt(f.d, survivor, 3));
  // The next version fills b and the survivor.
  b[0]->hang_version = 0;
  std::vector<EngineRank*> fleet = b;
  for (EngineRank* e : (peer == "a" ? other : f.a)) fleet.push_back(e);
  ExpectVersionCommits(f.d, f.TrainerPtrs(), fleet, 4, 2);
}

TEST_CASE("BeginVersion during a bootstrap waits for it: the peer is not "
          "overwritten while it is read") {
  DaemonOptions options;
  options.ack_timeout_ms = 1500;
  Fleet f(options);
  std::vector<EngineRank*> b = f.AddInstance("b", 4, false);
  b[2]->hang_version = 3;  // the bootstrap stalls in PAUSE...
  b[2]->hang_kind = v1::UPDATE_EVENT_KIND_PAUSE;
  f.Join(b);
  REQUIRE(Eventually([&] {
    return StreamOf(f.d, "policy").delivery().instance_id() == "b";
  }, absl::Seconds(10)));
  // ...and the trainer begins version 4 meanwhile: BeginVersion returns
  // only once the bootstrap settled (aborted by the ack timeout here).
  auto outcome = RunVersion(f.d, f.TrainerPtrs(), 4);
  for (auto& [status, resp] : outcome) {
    INFO(status.error_message());
    REQUIRE(status.ok());
    CHECK(resp.instances_size() == 2);
  }
  const v1::PeerDelivery last = StreamOf(f.d, "policy").delivery();
  CHECK(last.settled());
  CHECK(last.status().state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(last.status().abort_reason().find("did not ack PAUSE") !=
        std::string::npos);
  {
    std::lock_guard<std::mutex> lock(b[2]->mu);
    const auto& log = b[2]->log;
    auto at = [&](const std::string& l) {
      return std::find(log.begin(), log.end(), "UPDATE_EVENT_KIND_" + l) -
             log.begin();
    };
    INFO(absl::StrJoin(log, ", "));
    CHECK(at("ABORT 3") < at("PREPARE 4"));
  }
}

grpc::Status Reload(TestDaemon& d, const std::string& instance,
                    v1::ReloadInPlaceResponse* resp) {
  grpc::ClientContext ctx;
  v1::ReloadInPlaceRequest req;
  req.set_instance_id(instance);
  return d.lifecycle->ReloadInPlace(&ctx, req, resp);
}

TEST_CASE("ReloadInPlace restores every byte of a scribbled instance from a "
          "peer") {
  Fleet f;
  std::vector<EngineRank*> b = f.AddInstance("b", 4, false);
  f.Join(b);
  REQUIRE(Eventually([&] { return CommittedAt(f.d, "b", 3); },
                     absl::Seconds(10)));
  for (EngineRank* e : b) {
    std::memset(e->memory->data(), 0xff, e->memory->size());
    std::lock_guard<std::mutex> lock(e->mu);
    e->loaded_lm_head.clear();
  }
  REQUIRE(b[1]->Check(3) != "");
  v1::ReloadInPlaceResponse resp;
  grpc::Status s = Reload(f.d, "b", &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  CHECK(resp.status().state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(resp.status().committed_version() == 3);
  for (EngineRank* e : b) CHECK(e->Check(3) == "");
  const v1::PeerDelivery d = StreamOf(f.d, "policy").delivery();
  CHECK(d.kind() == "reload");
  CHECK(d.peer_instance_id() == "a");
}

TEST_CASE("ReloadInPlace: unknown instance, no peer, a version in progress") {
  Fleet f;
  std::vector<EngineRank*> b = f.AddInstance("b", 4, false);
  f.Join(b);
  REQUIRE(Eventually([&] { return CommittedAt(f.d, "b", 3); },
                     absl::Seconds(10)));
  v1::ReloadInPlaceResponse resp;
  grpc::Status s = Reload(f.d, "nobody", &resp);
  CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);

  // a's only possible peer is b, which holds lm_head in staging only.
  s = Reload(f.d, "a", &resp);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message().find("b receives lm_head.weight through its "
                               "loader") != std::string::npos);

  // A version begun and not committed: the reload would race it.
  v1::BeginVersionRequest begin;
  *begin.mutable_handle() = f.trainers[0]->handle;
  begin.set_version(4);
  v1::BeginVersionResponse began;
  grpc::ClientContext c1;
  REQUIRE(f.d.versions->BeginVersion(&c1, begin, &began).ok());
  s = Reload(f.d, "b", &resp);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
  CHECK(s.error_message() ==
        "ReloadInPlace(b): version 4 is in progress on stream policy");
  v1::AbortVersionRequest abort;
  *abort.mutable_handle() = f.trainers[0]->handle;
  abort.set_version(4);
  abort.set_reason("test");
  v1::AbortVersionResponse aborted;
  grpc::ClientContext c2;
  CHECK(f.d.versions->AbortVersion(&c2, abort, &aborted).ok());
}

}  // namespace
}  // namespace testing
}  // namespace ferry
