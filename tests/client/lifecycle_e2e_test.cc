// Lifecycle end to end with the real ferryd binary and the C++ clients
// (docs/api.md "Bootstrap and reload", "Model swap", "Load options"):
// engine ranks are DestinationClients with VerifyingEngines (the tiny demo
// model: fused qkv_proj and gate_up_proj), which check every live byte
// against the version's pattern (weight_pattern.h), an oracle independent
// of the planner. The trainer's memory is scribbled over before each peer
// delivery, so a byte read from it would show.
//
//   1. A late TP4 instance b bootstraps from a running TP2 instance a; b is
//      scribbled over and ReloadInPlace restores it; load_format
//      fallback_only then brings the next version through b's loader;
//      SwapModel moves b's four ranks to another stream, whose next version
//      lands.
//   2. kill -9 of a peer rank (a demo_engine process) while b's bootstrap
//      holds in APPLY: b ends ABORTED and dirty; the next version fills b.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/verifying_engine.h"
#include "client/destination_client.h"
#include "client/lifecycle_client.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "tests/client/in_process_trainer.h"
#include "tests/client/process_harness.h"

namespace ferry {
namespace {

constexpr absl::Duration kWait = absl::Seconds(30);
using testing::Eventually;
using testing::InProcessTrainer;

struct Dir {
  std::string path;
  Dir() {
    char t[] = "/tmp/ferry-life-XXXXXX";  // short: a unix socket path
    REQUIRE(mkdtemp(t) != nullptr);
    path = t;
  }
  ~Dir() { unlink(socket().c_str()); }
  std::string socket() const { return path + "/ferryd.sock"; }
};

std::unique_ptr<testing::Process> StartFerryd(const Dir& dir) {
  return testing::StartFerryd(
      {"--socket=" + dir.socket(), "--listen=", "--node=life",
       "--lease_ms=3000", "--ack_timeout_ms=20000",
       "--version_timeout_ms=30000", "--logtostderr"},
      dir.path + "/ferryd.log");
}

Connection Connect(const Dir& dir) {
  ConnectionOptions o;
  o.address = "unix:" + dir.socket();
  o.rpc_timeout = absl::Seconds(15);
  auto c = Connection::Open(o);
  REQUIRE(c.ok());
  REQUIRE(c->WaitForReady(kWait).ok());
  return *std::move(c);
}

// Every case's ferryd (a process of its own, in a fresh directory), a
// connection to it, and the tiny demo model.
struct Life {
  Life() : ferryd(StartFerryd(dir)), c(Connect(dir)) {
    absl::StatusOr<ModelSchema> s = LoadDemoModel("llama-3.1-8b", "tiny");
    REQUIRE(s.ok());
    schema = *std::move(s);
  }
  Dir dir;
  std::unique_ptr<testing::Process> ferryd;
  Connection c;
  ModelSchema schema;
};

// One engine rank in this process.
struct Rank {
  std::unique_ptr<VerifyingEngine> engine;
  std::unique_ptr<DestinationClient> client;
};

DestinationOptions Options(const std::string& id, const std::string& stream,
                           int tp, int rank) {
  DestinationOptions o;
  o.instance_id = id;
  o.stream = stream;
  o.tp_rank = rank;
  o.tp_size = tp;
  return o;
}

std::vector<Rank> AddInstance(const Connection& c, const ModelSchema& schema,
                              const std::string& id, int tp,
                              std::function<DestinationCallbacks(VerifyingEngine&)>
                                  callbacks = nullptr) {
  std::vector<Rank> ranks;
  for (int r = 0; r < tp; ++r) {
    auto engine = VerifyingEngine::Create(schema, tp, r, {},
                                          absl::StrCat("life.", id, ".", r));
    REQUIRE(engine.ok());
    auto client = DestinationClient::Register(
        c, Options(id, "policy", tp, r),
        DestinationLayout::FromEngineTable((*engine)->table(),
                                           {(*engine)->arena().Describe()}),
        callbacks ? callbacks(**engine) : (*engine)->Callbacks());
    INFO(client.status().ToString());
    REQUIRE(client.ok());
    ranks.push_back(Rank{*std::move(engine), *std::move(client)});
  }
  return ranks;
}

void ExpectHolds(std::vector<Rank>& ranks, int64_t v) {
  for (Rank& r : ranks) {
    INFO(r.client->who() << " at version " << v);
    REQUIRE(r.client->AwaitCommitted(v, kWait).ok());
    const absl::Status live = r.engine->VerifyLive(v);
    INFO(live.ToString());
    CHECK(live.ok());
  }
}

void Publish(InProcessTrainer& t, int64_t v, size_t instances) {
  absl::StatusOr<PublishOutcome> out = t.Publish(v);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  INFO(out->Summary());
  CHECK(out->instances.size() == instances);
  CHECK(out->all_committed());
}

v1::StreamInfo Stream(const Connection& c, const std::string& name) {
  v1::ListStreamsRequest request;
  request.set_stream(name);
  v1::ListStreamsResponse response;
  auto context = c.NewContext(absl::Seconds(5));
  if (!c.inspection().ListStreams(context.get(), request, &response).ok() ||
      response.streams_size() != 1) {
    return v1::StreamInfo();
  }
  return response.streams(0);
}

TEST_CASE("bootstrap, reload, fallback_only and a swap, with the real ferryd") {
  Life life;
  const Connection& c = life.c;
  const ModelSchema* schema = &life.schema;
  InProcessTrainer trainer(c, "life.trainer");
  std::vector<Rank> a = AddInstance(c, *schema, "a", 2);
  Publish(trainer, 1, 1);
  Publish(trainer, 2, 1);
  ExpectHolds(a, 2);
  trainer.Scribble();

  // b joins late at TP4 and is filled from a (TP2), resharded.
  std::vector<Rank> b = AddInstance(c, *schema, "b", 4);
  ExpectHolds(b, 2);
  const v1::StreamInfo info = Stream(c, "policy");
  CHECK(info.delivery().kind() == "bootstrap");
  CHECK(info.delivery().peer_instance_id() == "a");
  CHECK(info.delivery().bytes_moved() == info.delivery().bytes_total());

  // Scribbled over, then reloaded from a.
  for (Rank& r : b) {
    std::memset(r.engine->arena().data(), 0x5a, r.engine->arena().capacity());
  }
  CHECK_FALSE(b[0].engine->VerifyLive(2).ok());
  absl::StatusOr<v1::InstanceStatus> reloaded = ReloadInPlace(c, "b");
  INFO(reloaded.status().ToString());
  REQUIRE(reloaded.ok());
  CHECK(reloaded->state() == v1::INSTANCE_STATE_COMMITTED);
  for (Rank& r : b) CHECK(r.engine->VerifyLive(2).ok());

  // fallback_only: the next version through b's loader, bytes identical.
  auto config = GetConfig(c, "b");
  REQUIRE(config.ok());
  CHECK((*config)["load_format"] == "auto");
  config = UpdateConfig(c, "b", {{"load_format", "fallback_only"}});
  INFO(config.status().ToString());
  REQUIRE(config.ok());
  CHECK((*config)["load_format"] == "fallback_only");
  const int loaded_before = b[0].engine->fallback_tensors_loaded();
  Publish(trainer, 3, 2);
  ExpectHolds(a, 3);
  ExpectHolds(b, 3);
  CHECK(b[0].engine->fallback_tensors_loaded() - loaded_before ==
        static_cast<int>(schema->spec.params.size()));
  auto bad = UpdateConfig(c, "b", {{"load_format", "sometimes"}});
  CHECK(bad.status().code() == absl::StatusCode::kInvalidArgument);

  // SwapModel: b's four ranks move to stream "reference" together.
  InProcessTrainer reference(c, "life.reference", "reference");
  Publish(reference, 7, 0);
  std::vector<v1::ParticipantHandle> old;
  std::vector<absl::Status> swapped(b.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < b.size(); ++r) {
    old.push_back(b[r].client->handle());
    threads.emplace_back([&, r] {
      swapped[r] = b[r].client->SwapModel(
          Options("b", "reference", 4, static_cast<int>(r)),
          DestinationLayout::FromEngineTable(
              b[r].engine->table(), {b[r].engine->arena().Describe()}));
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : swapped) {
    INFO(s.ToString());
    CHECK(s.ok());
  }
  CHECK(b[0].client->handle().participant_id() != old[0].participant_id());
  Publish(reference, 8, 1);
  ExpectHolds(b, 8);
  Publish(trainer, 4, 1);  // the policy stream has only a now
  ExpectHolds(a, 4);
  b.clear();
  a.clear();
}

// The C++ client's offload callbacks over a SharedTensorArena: OFFLOAD
// releases it, ONLOAD makes a new one, which the client registers
// (UpdateRegions) before acking.
DestinationCallbacks OffloadingCallbacks(VerifyingEngine& e) {
  DestinationCallbacks cb = e.Callbacks();
  cb.on_offload = [&e](const std::vector<uint32_t>& ids, bool) {
    CHECK(ids == std::vector<uint32_t>{e.arena().region_id()});
    e.arena().Release();
    return absl::OkStatus();
  };
  cb.on_onload = [&e](const std::vector<uint32_t>&)
      -> absl::StatusOr<std::vector<v1::MemoryRegion>> {
    absl::Status s = e.arena().Reallocate();
    if (!s.ok()) return s;
    return std::vector<v1::MemoryRegion>{e.arena().Describe()};
  };
  return cb;
}

TEST_CASE("offload and onload with the C++ client: from the host copy, and "
          "from a peer after versions went by") {
  Life life;
  const Connection& c = life.c;
  const ModelSchema* schema = &life.schema;
  InProcessTrainer trainer(c, "life.trainer");
  std::vector<Rank> a = AddInstance(c, *schema, "a", 2);
  std::vector<Rank> b = AddInstance(c, *schema, "b", 4, OffloadingCallbacks);
  Publish(trainer, 1, 2);
  ExpectHolds(b, 1);
  trainer.Scribble();

  absl::StatusOr<v1::InstanceStatus> st = Offload(c, "b", true);
  INFO(st.status().ToString());
  REQUIRE(st.ok());
  CHECK(st->state() == v1::INSTANCE_STATE_OFFLOADED);
  for (Rank& r : b) CHECK(r.engine->arena().released());
  st = Onload(c, "b");
  REQUIRE(st.ok());
  INFO(st->DebugString());
  CHECK(st->state() == v1::INSTANCE_STATE_COMMITTED);
  for (Rank& r : b) {
    CHECK_FALSE(r.engine->arena().released());
    CHECK(r.engine->VerifyLive(1).ok());  // in its new arena, from the copy
  }

  // Offloaded again; two versions go by; the host copy is stale, so the
  // onload reshards from a (TP2 -> TP4).
  st = Offload(c, "b", true);
  REQUIRE(st.ok());
  CHECK(st->state() == v1::INSTANCE_STATE_OFFLOADED);
  for (int64_t v = 2; v <= 3; ++v) {
    absl::StatusOr<PublishOutcome> out = trainer.Publish(v);
    REQUIRE(out.ok());
    REQUIRE(out->instances.size() == 2);
    CHECK(out->instances[0].state() == v1::INSTANCE_STATE_COMMITTED);
    CHECK(out->instances[1].state() == v1::INSTANCE_STATE_OFFLOADED);
  }
  ExpectHolds(a, 3);
  trainer.Scribble();
  st = Onload(c, "b");
  REQUIRE(st.ok());
  CHECK(st->state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(st->committed_version() == 3);
  CHECK(Stream(c, "policy").delivery().peer_instance_id() == "a");
  for (Rank& r : b) CHECK(r.engine->VerifyLive(3).ok());
  Publish(trainer, 4, 2);
  ExpectHolds(a, 4);
  ExpectHolds(b, 4);
  b.clear();
  a.clear();
}

TEST_CASE("kill -9 of a peer rank mid-bootstrap: the instance ends ABORTED "
          "and dirty, and fills at the next version") {
  Life life;
  const Connection& c = life.c;
  const ModelSchema* schema = &life.schema;
  InProcessTrainer trainer(c, "life.kill.trainer");
  // The peer: two demo_engine processes.
  std::vector<std::unique_ptr<testing::Process>> peer;
  for (int r = 0; r < 2; ++r) {
    peer.push_back(testing::StartProcess(
        testing::Runfile("examples/demo/demo_engine"),
        {"--daemon=unix:" + life.dir.socket(), "--instance=a", "--tp=2",
         absl::StrCat("--tp_rank=", r), "--scale=tiny", "--timeout_s=60",
         "--logtostderr"},
        absl::StrCat(life.dir.path, "/a.", r, ".log")));
  }
  REQUIRE(Eventually([&] {
    const v1::StreamInfo info = Stream(c, "policy");
    for (const auto& i : info.instances()) {
      if (i.instance_id() == "a" && i.registered_tp_ranks_size() == 2) {
        return true;
      }
    }
    return false;
  }, kWait));
  Publish(trainer, 1, 1);
  trainer.Scribble();

  // b's rank 0 holds its APPLY (its buffers are written by then) until the
  // peer's rank is gone.
  absl::Notification peer_killed;
  std::vector<Rank> b =
      AddInstance(c, *schema, "b", 2, [&](VerifyingEngine& e) {
        DestinationCallbacks cb = e.Callbacks();
        auto apply = cb.on_apply;
        const bool gated = e.table().tp_rank == 0;
        cb.on_apply = [&, apply, gated](
                          int64_t v, const std::vector<FallbackTensorView>& t) {
          if (gated && v == 1) peer_killed.WaitForNotificationWithTimeout(kWait);
          return apply(v, t);
        };
        return cb;
      });
  REQUIRE(Eventually([&] {
    const v1::PeerDelivery d = Stream(c, "policy").delivery();
    return d.instance_id() == "b" &&
           d.status().state() == v1::INSTANCE_STATE_APPLY;
  }, kWait));
  peer[1]->Stop(SIGKILL, absl::Seconds(5));
  REQUIRE(Eventually([&] {
    return Stream(c, "policy").delivery().status().state() ==
           v1::INSTANCE_STATE_ABORTED;
  }, kWait));
  peer_killed.Notify();
  const v1::InstanceStatus s = Stream(c, "policy").delivery().status();
  INFO(s.DebugString());
  CHECK(s.dirty());
  CHECK(s.abort_reason().find("peer instance a tp rank 1 lost") !=
        std::string::npos);
  // a's other rank is still registered and serving; the next version
  // fills b (a is incomplete now and takes no part).
  Publish(trainer, 2, 1);
  ExpectHolds(b, 2);
  b.clear();
  peer[0]->Stop(SIGTERM, absl::Seconds(10));
}

}  // namespace
}  // namespace ferry
