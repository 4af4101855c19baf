// Several nodes end to end, with real processes and sockets: daemon A is
// the coordinator (trainer ranks on its node), daemons B and C are members
// (one demo_engine instance each, TP=2, on their own unix sockets). Every
// byte crosses a TcpChannel (Peer.OpenChannel, Peer.RunTransfer) and the
// engines verify it. Registrations, heartbeats, Subscribe and Ack go through
// the members' forwarding.
//
//   1. 3 versions from a 2-rank demo_trainer on A; both engines exit 0
//      (every byte verified). C's engine forces some parameters through
//      fallback, so they land in staging on C's node and APPLY names it.
//   1b. the trainer on member B, instances on B and C (A has no clients):
//      A asks B to send to C (RunTransfer role "send") and to copy B's
//      own instance locally (role "local").
//   1d. the trainer on member B, one TP2 instance on the coordinator A: B
//      sends (role "send", peer A) and A receives on its own node into
//      the memory and staging it mapped.
//   1c. one instance spread over two nodes (ranks on B and C, trainer on
//      B; ranks on A and C, trainer on A): one route per (source node,
//      destination node).
//   3. a client killed on a member is deregistered by the member's pid
//      watch.
//   2. kill -9 of daemon C while its instance stalls in APPLY of version 2
//      (after its transfer): C's instance ABORTED at version 1, B's
//      commits; C and its engines restart (--replace_existing) and version
//      3 commits on both.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "tests/client/in_process_trainer.h"
#include "tests/client/process_harness.h"
#include "tests/daemon/test_certs.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/weight_pattern.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/models/trainer_layout.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {
namespace {

constexpr absl::Duration kWait = absl::Seconds(30);

using testing::Eventually;
using testing::InProcessTrainer;
using testing::LogHas;
using testing::Process;
using testing::Runfile;
using testing::TlsFlags;

struct Dir {
  std::string path;
  Dir() {
    char t[] = "/tmp/ferry-nodes-XXXXXX";
    REQUIRE(mkdtemp(t) != nullptr);
    path = t;
  }
  std::string socket(const std::string& node) const {
    return path + "/" + node + ".sock";
  }
};

// One ferryd acting as a node; the coordinator when `coordinator` is empty.
struct Node {
  std::string name;
  std::unique_ptr<Process> process;
  int port = 0;
  int generation = 0;

  std::vector<std::string> extra_flags;

  void Start(const Dir& dir, const std::string& coordinator) {
    dir_path = dir.path;
    const std::string port_file = dir.path + "/" + name + ".port";
    unlink(port_file.c_str());
    std::vector<std::string> args = {
        "--node=" + name,        "--socket=" + dir.socket(name),
        "--listen=127.0.0.1:0",  "--port_file=" + port_file,
        "--peer_lease_ms=1500",  "--lease_ms=3000",
        "--ack_timeout_ms=20000", "--version_timeout_ms=30000",
        "--drain_timeout_ms=1000", "--logtostderr"};
    for (const std::string& f : TlsFlags(name)) args.push_back(f);
    if (!coordinator.empty()) args.push_back("--coordinator=" + coordinator);
    for (const std::string& f : extra_flags) args.push_back(f);
    ++generation;
    process = testing::StartFerryd(args, log());
    port = 0;
    REQUIRE(Eventually([&] {
      std::ifstream in(port_file);
      return static_cast<bool>(in >> port) && port > 0;
    }, kWait));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
  // The log of the latest Start.
  std::string log() const {
    return absl::StrCat(dir_path, "/", name, ".", generation - 1, ".log");
  }
  std::string dir_path;
};

std::unique_ptr<Process> StartEngine(const Dir& dir, const std::string& node,
                                     const std::string& id, int rank,
                                     int64_t exit_after,
                                     std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "--daemon=unix:" + dir.socket(node), "--instance=" + id, "--tp=2",
      absl::StrCat("--tp_rank=", rank), "--scale=tiny",
      absl::StrCat("--exit_after_version=", exit_after), "--timeout_s=60",
      "--logtostderr"};
  for (std::string& e : extra) args.push_back(std::move(e));
  static int serial = 0;
  return testing::StartProcess(
      Runfile("examples/demo/demo_engine"), std::move(args),
      absl::StrCat(dir.path, "/", id, ".", rank, ".", serial++, ".log"));
}

// Two demo_trainer ranks (TP2) registered on `node`, publishing versions
// 1-3 once `instances` instances are completely registered.
std::vector<std::unique_ptr<Process>> StartTrainers(const Dir& dir,
                                                    const std::string& node,
                                                    int instances) {
  std::vector<std::unique_ptr<Process>> trainers;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(testing::StartProcess(
        Runfile("examples/demo/demo_trainer"),
        std::vector<std::string>{
            "--daemon=unix:" + dir.socket(node), "--tp=2",
            absl::StrCat("--rank=", r), "--scale=tiny", "--versions=3",
            absl::StrCat("--wait_instances=", instances),
            "--wait_timeout_s=30", "--logtostderr"},
        absl::StrCat(dir.path, "/trainer.", r, ".log")));
  }
  return trainers;
}

// The coordinator reports version 3 moved bytes and is COMMITTED on every
// instance (and, unless -1, that there are `instances` of them).
void ExpectCommittedAt3(const Connection& conn, int instances) {
  v1::GetProgressRequest request;
  request.set_stream("policy");
  request.set_version(3);
  v1::GetProgressResponse progress;
  auto context = conn.NewContext(absl::Seconds(5));
  REQUIRE(conn.inspection().GetProgress(context.get(), request, &progress)
              .ok());
  CHECK(progress.bytes_moved() > 0);
  if (instances >= 0) REQUIRE(progress.instances_size() == instances);
  for (const v1::InstanceProgress& i : progress.instances()) {
    CHECK(i.status().state() == v1::INSTANCE_STATE_COMMITTED);
  }
}

Connection Connect(const std::string& address) {
  ConnectionOptions o;
  o.address = address;
  o.rpc_timeout = absl::Seconds(15);
  auto c = Connection::Open(o);
  REQUIRE(c.ok());
  REQUIRE(c->WaitForReady(kWait).ok());
  return *std::move(c);
}

bool MembersReachable(const Connection& c) {
  v1::GetHealthResponse h;
  auto context = c.NewContext(absl::Seconds(2));
  if (!c.inspection().GetHealth(context.get(), {}, &h).ok()) return false;
  int reachable = 0;
  for (const v1::PeerHealth& p : h.peers()) reachable += p.reachable();
  return reachable == 2;
}


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

// Nodes A (coordinator), B, C, and a connection to A; every daemon gets
// `flags` too.
struct Cluster {
  Dir dir;
  Node a{"node-a"}, b{"node-b"}, c{"node-c"};
  explicit Cluster(const std::vector<std::string>& flags = {}) {
    for (Node* n : {&a, &b, &c}) n->extra_flags = flags;
    a.Start(dir, "");
    b.Start(dir, a.address());
    c.Start(dir, a.address());
  }
};

// Once `instances` instances are complete, a 2-rank trainer on
// `trainer_node` publishes versions 1-3; every trainer and engine exits 0
// (each engine verified every byte) and A reports the instances committed
// at version 3 (`expect_instances` of them; -1: any number).
void PublishThreeVersions(const Cluster& k, const Connection& conn,
                          std::vector<std::unique_ptr<Process>>& engines,
                          const std::string& trainer_node, int instances,
                          int expect_instances) {
  INFO("logs in " << k.dir.path);
  REQUIRE(Eventually([&] { return InstancesComplete(conn, instances); }, kWait));
  std::vector<std::unique_ptr<Process>> trainers =
      StartTrainers(k.dir, trainer_node, instances);
  for (auto& t : trainers) CHECK(t->Wait(absl::Seconds(90)) == 0);
  for (auto& e : engines) CHECK(e->Wait(absl::Seconds(30)) == 0);
  ExpectCommittedAt3(conn, expect_instances);
}

// TP2 instances inst-b on B and inst-c on C (C's engine takes some
// parameters through fallback: staging on C), each exiting after version 3.
std::vector<std::unique_ptr<Process>> EnginesOnBAndC(const Cluster& k) {
  std::vector<std::unique_ptr<Process>> engines;
  for (int r = 0; r < 2; ++r) {
    engines.push_back(StartEngine(k.dir, "node-b", "inst-b", r, 3));
    engines.push_back(StartEngine(k.dir, "node-c", "inst-c", r, 3,
                                  {"--fallback=lm_head,layers.0.mlp"}));
  }
  return engines;
}

TEST_CASE("3 daemons: a 2-rank trainer on A feeds instances on B and C",
          "[multi_node]") {
  Cluster k;
  Connection conn = Connect("unix:" + k.dir.socket("node-a"));
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  std::vector<std::unique_ptr<Process>> engines = EnginesOnBAndC(k);
  PublishThreeVersions(k, conn, engines, "node-a", 2, -1);
}

TEST_CASE("3 daemons with --ucx_nodes=*: the trainer's bytes reach B and C "
          "over UCX channels",
          "[multi_node]") {
  // UCX over its tcp transport (this machine has no RDMA NIC): the same
  // code path a cluster runs over InfiniBand.
  Cluster k({"--ucx_nodes=*", "--ucx_transports=tcp"});
  Connection conn = Connect("unix:" + k.dir.socket("node-a"));
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  std::vector<std::unique_ptr<Process>> engines = EnginesOnBAndC(k);
  PublishThreeVersions(k, conn, engines, "node-a", 2, 2);
  // The engines checked every byte; the channels they came over were UCX.
  CHECK(LogHas(k.a.log(), "opened a ucx channel to node node-b"));
  CHECK(LogHas(k.a.log(), "opened a ucx channel to node node-c"));
  CHECK(LogHas(k.b.log(), "node node-a opens a ucx channel into this node"));
  CHECK(!LogHas(k.a.log(), "opened a tcp channel"));
}

TEST_CASE("ferryd refuses --ucx_transports it does not have, and a bad "
          "--ucx_nodes, naming the flag",
          "[multi_node]") {
  Dir dir;
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{"--ucx_transports=no-such-transport"},
        std::vector<std::string>{"--ucx_nodes=node-b,,node-c"}}) {
    std::vector<std::string> args = {"--node=solo",
                                     "--socket=" + dir.socket("solo"),
                                     "--logtostderr"};
    for (const std::string& f : flags) args.push_back(f);
    const std::string log = dir.path + "/solo.log";
    auto ferryd = testing::StartFerryd(args, log);
    CHECK(ferryd->Wait(absl::Seconds(20)) == 2);
    CHECK(LogHas(log, flags[0].substr(0, flags[0].find('='))));
  }
}

TEST_CASE("3 daemons: a 2-rank trainer on member B feeds instances on "
          "B and C; A has no clients",
          "[multi_node]") {
  Cluster k;
  Connection conn = Connect("unix:" + k.dir.socket("node-a"));
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  INFO("logs in " << k.dir.path);
  std::vector<std::unique_ptr<Process>> engines;
  for (int r = 0; r < 2; ++r) {
    // Some parameters through fallback: staging on C, filled by B.
    engines.push_back(StartEngine(k.dir, "node-c", "inst-c", r, 3,
                                  {"--fallback=lm_head,layers.0.mlp"}));
    // Same node as the trainer: B copies locally (role "local").
    engines.push_back(StartEngine(k.dir, "node-b", "inst-b", r, 3,
                                  {"--fallback=lm_head"}));
  }
  PublishThreeVersions(k, conn, engines, "node-b", 2, 2);
}

TEST_CASE("3 daemons: a 2-rank trainer on member B feeds a TP2 instance "
          "on the coordinator A",
          "[multi_node]") {
  Cluster k;
  Connection conn = Connect("unix:" + k.dir.socket("node-a"));
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  INFO("logs in " << k.dir.path);
  std::vector<std::unique_ptr<Process>> engines;
  for (int r = 0; r < 2; ++r) {
    // Some parameters through fallback: the coordinator's own staging,
    // filled from B's channel.
    engines.push_back(StartEngine(k.dir, "node-a", "inst-a", r, 3,
                                  {"--fallback=lm_head,layers.0.mlp"}));
  }
  PublishThreeVersions(k, conn, engines, "node-b", 1, 1);
}

// An instance spread over two nodes: rank 0 on `rank0_node`, rank 1 on C,
// fed by a 2-rank trainer on `trainer_node`; 3 versions verified.
void RunSpreadInstance(const std::string& trainer_node,
                       const std::string& rank0_node) {
  Cluster k;
  Connection conn = Connect("unix:" + k.dir.socket("node-a"));
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  INFO("logs in " << k.dir.path);
  std::vector<std::unique_ptr<Process>> engines;
  engines.push_back(StartEngine(k.dir, rank0_node, "inst-x", 0, 3,
                                {"--fallback=lm_head,layers.0.mlp"}));
  engines.push_back(StartEngine(k.dir, "node-c", "inst-x", 1, 3,
                                {"--fallback=lm_head,layers.0.mlp"}));
  PublishThreeVersions(k, conn, engines, trainer_node, 1, 1);
}

TEST_CASE("an instance spread over B and C, trainer on member B",
          "[multi_node]") {
  RunSpreadInstance("node-b", "node-b");
}

TEST_CASE("an instance spread over A and C, trainer on A", "[multi_node]") {
  RunSpreadInstance("node-a", "node-a");
}

TEST_CASE("kill -9 of member C mid-version aborts only C's instance; "
          "restarted, the next version commits",
          "[multi_node]") {
  Cluster k;
  Connection conn = Connect("unix:" + k.dir.socket("node-a"));
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  INFO("logs in " << k.dir.path);
  std::vector<std::unique_ptr<Process>> b_engines, c_engines;
  for (int r = 0; r < 2; ++r) {
    b_engines.push_back(StartEngine(k.dir, "node-b", "inst-b", r, 3));
    c_engines.push_back(StartEngine(k.dir, "node-c", "inst-c", r, 3,
                                    {"--stall_in=APPLY",
                                     "--stall_version=2"}));
  }
  REQUIRE(Eventually([&] { return InstancesComplete(conn, 2); }, kWait));
  InProcessTrainer trainer(conn, "multinode.trainer");

  auto v1 = trainer.Publish(1);
  REQUIRE(v1.ok());
  INFO(v1->Summary());
  REQUIRE(v1->all_committed());

  absl::StatusOr<PublishOutcome> v2 = absl::UnknownError("not run");
  std::thread publish([&] { v2 = trainer.Publish(2); });
  const bool stalled = Eventually([&] {
    v1::GetProgressRequest request;
    request.set_stream("policy");
    request.set_version(2);
    v1::GetProgressResponse response;
    auto context = conn.NewContext(absl::Seconds(2));
    if (!conn.inspection().GetProgress(context.get(), request, &response)
             .ok()) {
      return false;
    }
    for (const v1::InstanceProgress& i : response.instances()) {
      if (i.status().instance_id() == "inst-c" &&
          i.status().state() == v1::INSTANCE_STATE_APPLY) {
        return true;
      }
    }
    return false;
  }, kWait);
  k.c.process->Kill9();  // daemon C, mid-version
  for (auto& e : c_engines) e->Kill9();
  publish.join();
  REQUIRE(stalled);
  INFO(v2.status().ToString());
  REQUIRE(v2.ok());
  INFO(v2->Summary());
  const v1::InstanceStatus* b = Find(*v2, "inst-b");
  const v1::InstanceStatus* c = Find(*v2, "inst-c");
  REQUIRE(b != nullptr);
  REQUIRE(c != nullptr);
  CHECK(b->state() == v1::INSTANCE_STATE_COMMITTED);
  CHECK(c->state() == v1::INSTANCE_STATE_ABORTED);
  CHECK(c->committed_version() == 1);
  CHECK(c->dirty());  // its transfer had written its live buffers

  // C comes back: its daemon rejoins, its engines take their ranks back.
  k.c.Start(k.dir, k.a.address());
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  c_engines.clear();
  for (int r = 0; r < 2; ++r) {
    c_engines.push_back(StartEngine(k.dir, "node-c", "inst-c", r, 3,
                                    {"--replace_existing"}));
  }
  REQUIRE(Eventually([&] { return InstancesComplete(conn, 2); }, kWait));
  auto v3 = trainer.Publish(3);
  REQUIRE(v3.ok());
  INFO(v3->Summary());
  CHECK(v3->all_committed());
  for (auto& e : b_engines) CHECK(e->Wait(absl::Seconds(30)) == 0);
  for (auto& e : c_engines) CHECK(e->Wait(absl::Seconds(30)) == 0);
}

TEST_CASE("a member deregisters a client whose process exited",
          "[multi_node]") {
  Cluster k;
  Connection conn = Connect("unix:" + k.dir.socket("node-a"));
  REQUIRE(Eventually([&] { return MembersReachable(conn); }, kWait));
  INFO("logs in " << k.dir.path);
  auto engine = StartEngine(k.dir, "node-b", "inst-b", 0, 0);
  auto registered_ranks = [&] {
    int n = 0;
    const v1::StreamInfo info = StreamInfo(conn);
    for (const v1::InstanceInfo& i : info.instances()) {
      n += i.registered_tp_ranks_size();
    }
    return n;
  };
  REQUIRE(Eventually([&] { return registered_ranks() == 1; }, kWait));
  engine->Kill9();
  REQUIRE(Eventually([&] { return registered_ranks() == 0; }, kWait));
  // By node B's pid watch, not by the lease running out (B logs it once
  // the forwarded Deregister returned).
  CHECK(Eventually([&] {
    std::ifstream log(k.dir.path + "/node-b.0.log");
    std::string line;
    while (std::getline(log, line)) {
      if (line.find("its process exited; forwarded Deregister: OK") !=
          std::string::npos) {
        return true;
      }
    }
    return false;
  }, kWait));
}

}  // namespace
}  // namespace ferry
