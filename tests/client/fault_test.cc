// Faults with real processes: the real ferryd and demo_engine binaries
// (runfiles), a trainer rank in this process (SourceClient), temporary unix
// sockets. Each scenario waits on states the daemon reports (GetProgress,
// ListStreams, WaitForVersion) or on process exits, never on a fixed sleep.
//
//   1. kill -9 a destination rank while its instance is mid-version (its
//      rank stalled in APPLY, after the transfer wrote its live buffers):
//      that instance ends ABORTED (dirty) and still reports version 1,
//      the other instance commits version 2, and after the rank restarts
//      (--replace_existing, base weights: listed at committed_version 0)
//      version 3 commits on both.
//   2. kill -9 a trainer (source) rank of a TP2 trainer (demo_trainer
//      processes) mid-version, before it committed: the whole version
//      aborts, the instance ends ABORTED (clean: no byte was copied) and
//      still reports version 1; after both trainer ranks restart
//      (--replace_existing) version 3 commits and the engines verify it.
//   3. kill -9 ferryd between versions and start it again on the same
//      socket: the engine processes and the trainer register again on
//      their own and version 2 commits, every byte verified (also the
//      fallback tensors, in the new daemon's staging).
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "tests/client/in_process_trainer.h"
#include "tests/client/process_harness.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/weight_pattern.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/models/trainer_layout.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {
namespace {

constexpr absl::Duration kWait = absl::Seconds(20);

using testing::Eventually;
using testing::InProcessTrainer;
using testing::LogHas;
using testing::Process;
using testing::Runfile;

struct Dir {
  std::string path;
  Dir() {
    // Under /tmp: unix socket paths are short, Bazel's sandbox paths long.
    char t[] = "/tmp/ferry-fault-XXXXXX";
    REQUIRE(mkdtemp(t) != nullptr);
    path = t;
  }
  ~Dir() {
    // Logs are kept on failure for a human; removed otherwise by the OS
    // tmp cleaner. Remove only the socket here.
    unlink((path + "/ferryd.sock").c_str());
  }
  std::string socket() const { return path + "/ferryd.sock"; }
};

std::unique_ptr<Process> StartFerryd(const Dir& dir, int generation) {
  return testing::StartFerryd(
      std::vector<std::string>{"--socket=" + dir.socket(), "--listen=",
                               "--node=fault", "--lease_ms=3000",
                               "--ack_timeout_ms=20000",
                               "--version_timeout_ms=30000", "--logtostderr"},
      absl::StrCat(dir.path, "/ferryd.", generation, ".log"));
}

std::unique_ptr<Process> StartEngine(const Dir& dir, const std::string& id,
                                     int tp, int rank, int64_t exit_after,
                                     std::vector<std::string> extra = {},
                                     std::string* log_path = nullptr) {
  std::vector<std::string> args = {
      "--daemon=unix:" + dir.socket(), "--instance=" + id,
      absl::StrCat("--tp=", tp), absl::StrCat("--tp_rank=", rank),
      "--scale=tiny", absl::StrCat("--exit_after_version=", exit_after),
      "--timeout_s=50", "--logtostderr"};
  for (std::string& e : extra) args.push_back(std::move(e));
  static int serial = 0;
  const std::string log =
      absl::StrCat(dir.path, "/", id, ".", rank, ".", serial++, ".log");
  if (log_path != nullptr) *log_path = log;
  return testing::StartProcess(Runfile("examples/demo/demo_engine"),
                                   std::move(args), log);
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

// The stream as ListStreams reports it (empty name when unknown).
v1::StreamInfo StreamInfo(const Connection& c) {
  v1::ListStreamsRequest request;
  request.set_stream("policy");
  v1::ListStreamsResponse response;
  auto context = c.NewContext(absl::Seconds(2));
  if (!c.inspection().ListStreams(context.get(), request, &response).ok() ||
      response.streams_size() != 1) {
    return v1::StreamInfo();
  }
  return response.streams(0);
}

bool InstancesComplete(const Connection& c, int want) {
  int complete = 0;
  const v1::StreamInfo info = StreamInfo(c);
  for (const v1::InstanceInfo& i : info.instances()) {
    if (i.registered_tp_ranks_size() == i.tp_size()) ++complete;
  }
  return complete == want;
}

const v1::InstanceStatus* Find(const PublishOutcome& o, const std::string& id) {
  for (const v1::InstanceStatus& s : o.instances) {
    if (s.instance_id() == id) return &s;
  }
  return nullptr;
}

absl::StatusOr<v1::InstanceStatus> WaitFor(const Connection& c, int64_t v,
                                           const std::string& id) {
  v1::WaitForVersionRequest request;
  request.set_stream("policy");
  request.set_version(v);
  request.set_instance_id(id);
  request.set_timeout_ms(absl::ToInt64Milliseconds(kWait));
  v1::WaitForVersionResponse response;
  auto context = c.NewContext(kWait + absl::Seconds(5));
  grpc::Status s = c.versions().WaitForVersion(context.get(), request, &response);
  if (!s.ok()) return FromGrpcStatus(s, "WaitForVersion");
  if (response.instances_size() != 1) return absl::InternalError("no instance");
  return response.instances(0);
}

TEST_CASE("a destination rank killed mid-version aborts only its instance") {
  Dir dir;
  auto ferryd = StartFerryd(dir, 0);
  Connection c = Connect(dir);
  auto a = StartEngine(dir, "healthy", 1, 0, 3);
  auto b = StartEngine(dir, "victim", 1, 0, 3,
                       {"--stall_in=APPLY", "--stall_version=2"});
  REQUIRE(Eventually([&] { return InstancesComplete(c, 2); }, kWait));
  InProcessTrainer trainer(c, "fault.trainer");

  auto v1 = trainer.Publish(1);
  REQUIRE(v1.ok());
  INFO(v1->Summary());
  REQUIRE(v1->all_committed());

  // Version 2: the victim's rank stalls in APPLY (its live buffers were
  // written), the publish blocks until every instance settles.
  absl::StatusOr<PublishOutcome> v2 = absl::UnknownError("not run");
  std::thread publish([&] { v2 = trainer.Publish(2); });
  const bool stalled = Eventually([&] {
    v1::GetProgressRequest request;
    request.set_stream("policy");
    request.set_version(2);
    v1::GetProgressResponse response;
    auto context = c.NewContext(absl::Seconds(2));
    if (!c.inspection().GetProgress(context.get(), request, &response).ok()) {
      return false;
    }
    for (const v1::InstanceProgress& i : response.instances()) {
      if (i.status().instance_id() == "victim" &&
          i.status().state() == v1::INSTANCE_STATE_APPLY &&
          i.status().waiting_on_tp_ranks_size() == 1) {
        return true;
      }
    }
    return false;
  }, kWait);
  if (!stalled) b->Kill9();  // unblock the publish before failing
  REQUIRE(stalled);
  b->Kill9();
  publish.join();

  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  INFO(v2->Summary());
  const v1::InstanceStatus* healthy = Find(*v2, "healthy");
  const v1::InstanceStatus* victim = Find(*v2, "victim");
  REQUIRE(healthy != nullptr);
  REQUIRE(victim != nullptr);
  CHECK(healthy->state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(victim->state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(victim->committed_version() == 1);
  CHECK(victim->dirty());

  auto waited = WaitFor(c, 2, "victim");
  REQUIRE(waited.ok());
  CHECK(waited->state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(waited->committed_version() == 1);

  // The rank comes back; the next version reaches both instances.
  auto b2 = StartEngine(dir, "victim", 1, 0, 3, {"--replace_existing"});
  REQUIRE(Eventually([&] { return InstancesComplete(c, 2); }, kWait));
  // Listed again: still ABORTED (version 2) until a version commits on it,
  // now at committed_version 0: the new process holds the base weights.
  bool listed = false;
  const v1::StreamInfo info = StreamInfo(c);
  for (const v1::InstanceInfo& i : info.instances()) {
    if (i.instance_id() != "victim") continue;
    listed = true;
    CHECK(i.status().state() == v1::INSTANCE_STATE_ABORTED);
    CHECK(i.status().committed_version() == 0);
  }
  CHECK(listed);
  auto v3 = trainer.Publish(3);
  REQUIRE(v3.ok());
  INFO(v3->Summary());
  CHECK(v3->all_committed());
  CHECK(a->Wait(kWait) == 0);   // every byte of versions 1..3 verified
  CHECK(b2->Wait(kWait) == 0);  // version 3 verified
}

std::unique_ptr<Process> StartTrainer(const Dir& dir, int rank, int64_t first,
                                      int versions,
                                      std::vector<std::string> extra,
                                      std::string* log_path) {
  std::vector<std::string> args = {
      "--daemon=unix:" + dir.socket(), "--tp=2", absl::StrCat("--rank=", rank),
      "--scale=tiny", absl::StrCat("--first_version=", first),
      absl::StrCat("--versions=", versions), "--wait_timeout_s=20",
      "--logtostderr"};
  for (std::string& e : extra) args.push_back(std::move(e));
  static int serial = 0;
  *log_path = absl::StrCat(dir.path, "/trainer.", rank, ".", serial++, ".log");
  return testing::StartProcess(Runfile("examples/demo/demo_trainer"),
                                   std::move(args), *log_path);
}

// The instance's status in version `v` as GetProgress reports it (empty
// instance_id when not reported).
v1::InstanceStatus ProgressOf(const Connection& c, int64_t v,
                              const std::string& id) {
  v1::GetProgressRequest request;
  request.set_stream("policy");
  request.set_version(v);
  v1::GetProgressResponse response;
  auto context = c.NewContext(absl::Seconds(2));
  if (c.inspection().GetProgress(context.get(), request, &response).ok()) {
    for (const v1::InstanceProgress& i : response.instances()) {
      if (i.status().instance_id() == id) return i.status();
    }
  }
  return v1::InstanceStatus();
}

TEST_CASE("a source rank killed mid-version aborts the version") {
  Dir dir;
  auto ferryd = StartFerryd(dir, 0);
  Connection c = Connect(dir);
  std::string e0_log, e1_log, t0_log, t1_log;
  auto e0 = StartEngine(dir, "engine", 2, 0, 3, {}, &e0_log);
  auto e1 = StartEngine(dir, "engine", 2, 1, 3, {}, &e1_log);
  REQUIRE(Eventually([&] { return InstancesComplete(c, 1); }, kWait));
  // A TP2 trainer publishing versions 1 and 2; rank 1 begins version 2 and
  // then hangs before committing it.
  auto t0 = StartTrainer(dir, 0, 1, 2, {}, &t0_log);
  auto t1 = StartTrainer(dir, 1, 1, 2, {"--stall_before_commit_version=2"},
                         &t1_log);

  // Version 2: rank 1 stalled and every engine rank acked PREPARE, so the
  // instance waits for the sources' commits (no byte copied yet).
  const bool stalled = Eventually([&] {
    if (!LogHas(t1_log, "STALLED before CommitVersion v2")) return false;
    const v1::InstanceStatus s = ProgressOf(c, 2, "engine");
    return s.state() == v1::INSTANCE_STATE_PREPARE &&
           s.waiting_on_tp_ranks_size() == 0;
  }, kWait);
  REQUIRE(stalled);
  auto v1 = WaitFor(c, 1, "engine");  // settled: rank 1 went on to v2
  INFO(v1.status().ToString());
  REQUIRE(v1.ok());
  CHECK(v1->state() == v1::INSTANCE_STATE_COMMITTED);
  t1->Kill9();

  // The daemon notices the process is gone (or, failing that, its lease
  // runs out): the whole version aborts.
  auto v2 = WaitFor(c, 2, "engine");
  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  INFO(v2->abort_reason());
  CHECK(v2->state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(v2->committed_version() == 1);
  CHECK_FALSE(v2->dirty());
  CHECK(v2->abort_reason().find("source rank 1 lost") != std::string::npos);
  const v1::InstanceStatus progress = ProgressOf(c, 2, "engine");
  CHECK(progress.state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(progress.committed_version() == 1);
  CHECK_FALSE(progress.dirty());
  // Rank 0's CommitVersion(2) fails ABORTED; demo_trainer exits 2.
  CHECK(t0->Wait(kWait) == 2);
  CHECK(LogHas(t0_log, "ABORTED: CommitVersion(2)"));
  REQUIRE(Eventually([&] {
    return LogHas(e0_log, "ABORT v2 (clean)") && LogHas(e1_log, "ABORT v2 (clean)");
  }, kWait));

  // Both trainer ranks come back and publish version 3.
  auto r0 = StartTrainer(dir, 0, 3, 1, {"--replace_existing"}, &t0_log);
  auto r1 = StartTrainer(dir, 1, 3, 1, {"--replace_existing"}, &t1_log);
  CHECK(r0->Wait(kWait + kWait) == 0);  // version 3 committed everywhere
  CHECK(r1->Wait(kWait) == 0);
  auto v3 = WaitFor(c, 3, "engine");
  INFO("WaitForVersion(3): " << v3.status().ToString());
  REQUIRE(v3.ok());
  CHECK(v3->state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(v3->committed_version() == 3);
  // The engines verified versions 1 and 3 byte for byte; they exit 1, as
  // documented, because they saw version 2 abort.
  CHECK(e0->Wait(kWait) == 1);
  CHECK(e1->Wait(kWait) == 1);
  for (const std::string& log : {e0_log, e1_log}) {
    INFO(log);
    CHECK(LogHas(log, "COMMIT v1: OK"));
    CHECK(LogHas(log, "COMMIT v3: OK"));
    CHECK(LogHas(log, "holds version 3; 0 mismatches, 1 aborted versions"));
  }
}

TEST_CASE("clients register again with a restarted daemon and carry on") {
  Dir dir;
  auto ferryd = StartFerryd(dir, 0);
  Connection c = Connect(dir);
  std::string e0_log, e1_log;
  // lm_head through fallback: the restarted daemon's staging reuses the
  // region ids of the old one's, and the ranks must map the new files.
  auto e0 = StartEngine(dir, "engine", 2, 0, 2, {"--fallback=lm_head"}, &e0_log);
  auto e1 = StartEngine(dir, "engine", 2, 1, 2, {"--fallback=lm_head"}, &e1_log);
  REQUIRE(Eventually([&] { return InstancesComplete(c, 1); }, kWait));
  InProcessTrainer trainer(c, "fault.trainer");
  auto v1 = trainer.Publish(1);
  REQUIRE(v1.ok());
  INFO(v1->Summary());
  REQUIRE(v1->all_committed());

  // Between versions: both ranks saw COMMIT v1 (it needs no ack, so only
  // their logs say so; killing ferryd before it reached a rank would leave
  // the ranks disagreeing on the version they hold).
  REQUIRE(Eventually([&] {
    return LogHas(e0_log, "COMMIT v1: OK") && LogHas(e1_log, "COMMIT v1: OK");
  }, kWait));
  ferryd->Kill9();
  ferryd = StartFerryd(dir, 1);
  REQUIRE(c.WaitForReady(kWait).ok());
  // The engines notice on their own (their Subscribe breaks) and register
  // again, saying they hold version 1.
  REQUIRE(Eventually([&] { return InstancesComplete(c, 1); }, kWait));
  const v1::StreamInfo info = StreamInfo(c);
  REQUIRE(info.instances_size() == 1);
  CHECK(info.instances(0).status().committed_version() == 1);

  // The trainer's next version registers it again first.
  auto v2 = trainer.Publish(2);
  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  INFO(v2->Summary());
  CHECK(v2->all_committed());
  CHECK(trainer.client().reregistrations() == 1);
  CHECK(e0->Wait(kWait) == 0);  // versions 1 and 2 verified
  CHECK(e1->Wait(kWait) == 0);
}

}  // namespace
}  // namespace ferry
