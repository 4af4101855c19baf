// Several ferryd processes acting as nodes (separate ports and sockets):
// members join the coordinator with --coordinator, heartbeat it, are
// reported by GetHealth, lose their lease when killed -9, take their node
// back when restarted, and leave on SIGTERM. A member validates
// registrations itself before forwarding them (multi_node_e2e_test.cc runs
// the data path).
#include <signal.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "grpcpp/grpcpp.h"
#include "tests/client/process_harness.h"
#include "tests/daemon/daemon_test_support.h"
#include "tests/daemon/test_certs.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "proto/ferry/v1/registration.grpc.pb.h"

namespace {

std::chrono::system_clock::time_point In(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

using ferry::testing::Eventually;

// One ferryd process acting as a node (SIGKILLed on destruction).
struct Daemon {
  std::string node;
  std::string dir;
  std::string socket;
  std::string port_file;
  std::unique_ptr<ferry::testing::Process> process;
  int port = 0;

  // Starts it, a member of `coordinator` ("": the coordinator itself);
  // waits for the port it listens on.
  void Start(const std::string& coordinator) {
    ::unlink(port_file.c_str());
    std::vector<std::string> args = {
        "--node=" + node,           "--socket=" + socket,
        "--listen=127.0.0.1:0",     "--port_file=" + port_file,
        "--peer_lease_ms=1500",     "--drain_timeout_ms=1000"};
    if (!coordinator.empty()) args.push_back("--coordinator=" + coordinator);
    Launch(std::move(args));
    port = 0;
    REQUIRE(Eventually(
        [&] {
          std::ifstream in(port_file);
          return static_cast<bool>(in >> port) && port > 0;
        },
        absl::Seconds(11)));
  }

  // Starts it with `args` and its TLS flags, returning at once.
  void Launch(std::vector<std::string> args) {
    for (const std::string& f : ferry::testing::TlsFlags(node)) {
      args.push_back(f);
    }
    process = ferry::testing::StartFerryd(std::move(args), /*log=*/"");
  }

  std::string address() const { return "127.0.0.1:" + std::to_string(port); }

  // Sends `signal`, waits up to 15 s (then SIGKILL); waitpid's status.
  int Stop(int signal) {
    if (process == nullptr) return -1;
    process->Stop(signal, absl::Seconds(15));
    const int status = process->wait_status();
    process.reset();
    return status;
  }
};

// The unix socket as is; a TCP port with the operator's certificate.
std::shared_ptr<grpc::Channel> ChannelTo(const std::string& target) {
  if (target.rfind("unix:", 0) == 0) {
    return grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  }
  return ferry::testing::TcpChannel(target);
}

ferry::v1::GetHealthResponse Health(const std::string& target) {
  auto channel = ChannelTo(target);
  auto stub = ferry::v1::Inspection::NewStub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(5000));
  ferry::v1::GetHealthRequest req;
  ferry::v1::GetHealthResponse resp;
  grpc::Status s = stub->GetHealth(&ctx, req, &resp);
  INFO(s.error_message());
  REQUIRE(s.ok());
  return resp;
}

const ferry::v1::PeerHealth* FindPeer(const ferry::v1::GetHealthResponse& h,
                                      const std::string& node) {
  for (const auto& p : h.peers()) {
    if (p.node() == node) return &p;
  }
  return nullptr;
}

// Polls GetHealth on `target` until `pred` holds (or `ms` pass).
bool WaitForHealth(
    const std::string& target, int ms,
    const std::function<bool(const ferry::v1::GetHealthResponse&)>& pred) {
  return Eventually([&] { return pred(Health(target)); },
                    absl::Milliseconds(ms), absl::Milliseconds(50));
}

bool Reachable(const ferry::v1::GetHealthResponse& h, const std::string& n) {
  const ferry::v1::PeerHealth* p = FindPeer(h, n);
  return p != nullptr && p->reachable();
}

}  // namespace

TEST_CASE("daemons join a coordinator, heartbeat, lose and retake their node",
          "[multi_node]") {
  char tmpl[] = "/tmp/ferryd-nodes-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  Daemon a, b, c;
  for (auto [d, name] : {std::pair<Daemon*, const char*>{&a, "node-a"},
                         {&b, "node-b"},
                         {&c, "node-c"}}) {
    d->node = name;
    d->socket = dir + "/" + name + ".sock";
    d->port_file = dir + "/" + name + ".port";
  }
  a.Start("");
  b.Start(a.address());
  c.Start(a.address());
  const std::string coordinator = a.address();

  // The coordinator lists both members as reachable.
  CHECK(WaitForHealth(coordinator, 10000, [](const auto& h) {
    return Reachable(h, "node-b") && Reachable(h, "node-c");
  }));
  {
    ferry::v1::GetHealthResponse h = Health(coordinator);
    CHECK(h.role() == ferry::v1::DAEMON_ROLE_COORDINATOR);
    CHECK(h.coordinator_node() == "node-a");
    CHECK(h.problems_size() == 0);
  }
  // A member says so, names its coordinator and reports it reachable (its
  // unix socket and its TCP port alike).
  CHECK(WaitForHealth("unix:" + b.socket, 5000, [](const auto& h) {
    return h.role() == ferry::v1::DAEMON_ROLE_MEMBER &&
           h.coordinator_node() == "node-a" && Reachable(h, "node-a");
  }));
  CHECK(Health(c.address()).role() == ferry::v1::DAEMON_ROLE_MEMBER);

  // A peer's stub, presenting the certificate of node `as`.
  auto peer_stub = [](const std::string& target, const std::string& as) {
    return ferry::v1::Peer::NewStub(ferry::testing::TcpChannel(target, as));
  };
  SECTION("membership errors") {
    auto peer = peer_stub(coordinator, "node-b");
    ferry::v1::JoinCoordinatorRequest join;
    join.set_node("node-b");
    join.set_peer_address("127.0.0.1:1");
    ferry::v1::JoinCoordinatorResponse joined;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      CHECK(peer->JoinCoordinator(&ctx, join, &joined).error_code() ==
            grpc::StatusCode::ALREADY_EXISTS);
    }
    {
      join.set_node("node-a");  // the coordinator's own name
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      CHECK(peer_stub(coordinator, "node-a")
                ->JoinCoordinator(&ctx, join, &joined)
                .error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    }
    {
      // Rails past the bound, or not an address: refused, naming why,
      // before the membership changes.
      ferry::v1::JoinCoordinatorRequest rails = join;
      rails.set_node("node-r");
      for (int i = 0; i < 17; ++i) rails.add_rails("10.0.0.1");
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      grpc::Status s = peer_stub(coordinator, "node-r")
                           ->JoinCoordinator(&ctx, rails, &joined);
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(s.error_message().find("names 17 rails (at most 16)") !=
            std::string::npos);
      rails.clear_rails();
      rails.add_rails(std::string(65, '1'));
      grpc::ClientContext ctx2;
      ctx2.set_deadline(In(5000));
      s = peer_stub(coordinator, "node-r")->JoinCoordinator(&ctx2, rails, &joined);
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(s.error_message().find("must be an address of 1 to 64 bytes") !=
            std::string::npos);
    }
    {
      join.set_node("node-x");  // a member is not the coordinator
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      grpc::Status s = peer_stub(b.address(), "node-x")
                           ->JoinCoordinator(&ctx, join, &joined);
      CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
      CHECK(s.error_message().find(coordinator) != std::string::npos);
    }
    {
      ferry::v1::PeerHeartbeatRequest hb;
      hb.mutable_handle()->set_node("node-b");
      hb.mutable_handle()->set_token("not-the-token");
      ferry::v1::PeerHeartbeatResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      CHECK(peer->PeerHeartbeat(&ctx, hb, &resp).error_code() ==
            grpc::StatusCode::PERMISSION_DENIED);
    }
    {
      // Forwarded registrations need a live membership. A stale token (the
      // member's membership from before a coordinator restart) is
      // UNAVAILABLE: the member joins again, and its rank retries.
      ferry::v1::ForwardRegistrationRequest fwd;
      fwd.mutable_member()->set_node("node-b");
      fwd.mutable_member()->set_token("not-the-token");
      fwd.mutable_source()->mutable_source()->set_stream("policy");
      ferry::v1::ForwardRegistrationResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      const grpc::Status s = peer->ForwardRegistration(&ctx, fwd, &resp);
      CHECK(s.error_code() == grpc::StatusCode::UNAVAILABLE);
      CHECK(s.error_message().find("wrong membership token") !=
            std::string::npos);
    }
    {
      // A channel epoch must grow.
      ferry::v1::OpenChannelRequest open;
      open.set_caller_node("node-a");
      open.set_channel_id("node-a->node-b");
      open.set_epoch(7);
      open.mutable_tcp()->set_connection_count(1);
      ferry::v1::OpenChannelResponse opened;
      auto member = peer_stub(b.address(), "node-a");
      {
        grpc::ClientContext ctx;
        ctx.set_deadline(In(5000));
        grpc::Status s = member->OpenChannel(&ctx, open, &opened);
        INFO(s.error_message());
        CHECK(s.ok());
        CHECK(!opened.tcp().address().empty());
        CHECK(!opened.tcp().connection_token().empty());
      }
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      CHECK(member->OpenChannel(&ctx, open, &opened).error_code() ==
            grpc::StatusCode::FAILED_PRECONDITION);
    }
    {
      // A member parses a registration itself before forwarding it.
      auto reg = ferry::v1::Registry::NewStub(grpc::CreateChannel(
          "unix:" + b.socket, grpc::InsecureChannelCredentials()));
      ferry::v1::RegisterSourceRequest req;
      req.mutable_source()->set_stream("policy");
      ferry::v1::RegisterSourceResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      grpc::Status s = reg->RegisterSource(&ctx, req, &resp);
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    }
  }

  SECTION("a member relays its ranks' heartbeats, each answered as its own") {
    auto reg = ferry::v1::Registry::NewStub(grpc::CreateChannel(
        "unix:" + b.socket, grpc::InsecureChannelCredentials()));
    ferry::testing::TrainerRank t0(0, "policy"), t1(1, "policy");
    for (ferry::testing::TrainerRank* t : {&t0, &t1}) {
      ferry::v1::RegisterSourceResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(In(10000));
      grpc::Status s = reg->RegisterSource(&ctx, t->Registration(), &resp);
      INFO(s.error_message());
      REQUIRE(s.ok());
      t->handle = resp.handle();
    }
    ferry::v1::ParticipantHandle forged = t1.handle;
    forged.set_token("forged");
    // Twelve heartbeats at once through the member (it batches them for
    // the coordinator): each gets its own answer.
    const std::vector<ferry::v1::ParticipantHandle> handles = {
        t0.handle, t1.handle, forged};
    std::vector<grpc::Status> answers(12);
    std::vector<int64_t> leases(12, 0);
    std::vector<std::thread> threads;
    for (int i = 0; i < 12; ++i) {
      threads.emplace_back([&, i] {
        ferry::v1::HeartbeatRequest hb;
        *hb.mutable_handle() = handles[i % 3];
        ferry::v1::HeartbeatResponse resp;
        grpc::ClientContext ctx;
        ctx.set_deadline(In(10000));
        answers[i] = reg->Heartbeat(&ctx, hb, &resp);
        leases[i] = resp.lease_duration_ms();
      });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < 12; ++i) {
      INFO("heartbeat " << i << ": " << answers[i].error_message());
      if (i % 3 == 2) {
        CHECK(answers[i].error_code() == grpc::StatusCode::PERMISSION_DENIED);
      } else {
        CHECK(answers[i].ok());
        CHECK(leases[i] == 10000);  // the coordinator's --lease_ms
      }
    }
    // A handle the coordinator would refuse outright is refused by the
    // member, and rides in no batch.
    ferry::v1::HeartbeatRequest bad;
    *bad.mutable_handle() = t0.handle;
    bad.mutable_handle()->set_participant_id(std::string(5000, 'x'));
    ferry::v1::HeartbeatResponse resp;
    grpc::ClientContext ctx;
    ctx.set_deadline(In(10000));
    CHECK(reg->Heartbeat(&ctx, bad, &resp).error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
  }

  SECTION("a member's ranks' Subscribe streams end UNAVAILABLE when the "
          "coordinator goes away, so their clients subscribe again") {
    auto channel = grpc::CreateChannel("unix:" + b.socket,
                                       grpc::InsecureChannelCredentials());
    auto reg = ferry::v1::Registry::NewStub(channel);
    ferry::testing::EngineRank e0("e0", 0, "policy");
    {
      ferry::v1::RegisterDestinationResponse resp;
      grpc::ClientContext ctx;
      ctx.set_deadline(In(10000));
      grpc::Status s = reg->RegisterDestination(&ctx, e0.Registration(), &resp);
      INFO(s.error_message());
      REQUIRE(s.ok());
      e0.handle = resp.handle();
    }
    auto versions = ferry::v1::Versions::NewStub(channel);
    grpc::ClientContext sub_ctx;
    sub_ctx.set_deadline(In(30000));
    ferry::v1::SubscribeRequest sub;
    *sub.mutable_handle() = e0.handle;
    std::unique_ptr<grpc::ClientReader<ferry::v1::UpdateEvent>> stream =
        versions->Subscribe(&sub_ctx, sub);
    // The coordinator holds the subscription (relayed by member b).
    auto inspection = ferry::v1::Inspection::NewStub(
        ferry::testing::TcpChannel(coordinator));
    REQUIRE(Eventually(
        [&] {
          grpc::ClientContext ctx;
          ctx.set_deadline(In(2000));
          ferry::v1::ListParticipantsResponse list;
          if (!inspection->ListParticipants(&ctx, {}, &list).ok()) return false;
          for (const auto& p : list.participants()) {
            if (p.participant_id() == e0.handle.participant_id()) {
              return p.destination().subscribed();
            }
          }
          return false;
        },
        absl::Seconds(10)));
    a.Stop(SIGKILL);
    ferry::v1::UpdateEvent event;
    while (stream->Read(&event)) {
    }
    const grpc::Status s = stream->Finish();
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::UNAVAILABLE);
    CHECK(s.error_message().find("coordinator") != std::string::npos);
  }

  SECTION("kill -9 of a member: its lease runs out; restarted, it rejoins") {
    c.Stop(SIGKILL);
    CHECK(WaitForHealth(coordinator, 8000, [](const auto& h) {
      const ferry::v1::PeerHealth* p = FindPeer(h, "node-c");
      bool problem = false;
      for (const auto& line : h.problems()) {
        problem |= line.find("node-c") != std::string::npos;
      }
      return p != nullptr && !p->reachable() && problem &&
             Reachable(h, "node-b");
    }));
    c.Start(coordinator);
    CHECK(WaitForHealth(coordinator, 8000, [](const auto& h) {
      return Reachable(h, "node-c") && Reachable(h, "node-b") &&
             h.problems_size() == 0;
    }));
  }

  SECTION("SIGTERM: a member leaves; a restarted coordinator is rejoined") {
    CHECK(WIFEXITED(b.Stop(SIGTERM)));
    CHECK(WaitForHealth(coordinator, 5000, [](const auto& h) {
      return FindPeer(h, "node-b") == nullptr && Reachable(h, "node-c");
    }));
    // The coordinator restarts on the same port: its members' heartbeats
    // get NOT_FOUND and they join again.
    const int port = a.port;
    CHECK(WIFEXITED(a.Stop(SIGTERM)));
    // Reuse the port: --listen with the old port.
    a.Launch({"--node=node-a", "--socket=" + a.socket,
              "--listen=127.0.0.1:" + std::to_string(port),
              "--peer_lease_ms=1500"});
    CHECK(WaitForHealth("unix:" + c.socket, 10000, [](const auto&) {
      return true;
    }));
    const bool rejoined = Eventually(
        [&] {
          auto channel = ferry::testing::TcpChannel(coordinator);
          auto stub = ferry::v1::Inspection::NewStub(channel);
          grpc::ClientContext ctx;
          ctx.set_deadline(In(1000));
          ferry::v1::GetHealthResponse h;
          return stub->GetHealth(&ctx, {}, &h).ok() && Reachable(h, "node-c");
        },
        absl::Seconds(10), absl::Milliseconds(50));
    CHECK(rejoined);
  }

  c.Stop(SIGTERM);
  b.Stop(SIGTERM);
  a.Stop(SIGTERM);
  std::string cmd = "rm -rf '" + dir + "'";
  (void)::system(cmd.c_str());
}
