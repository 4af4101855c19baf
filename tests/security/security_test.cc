// ferryd does not trust its callers (issue 9; docs/api.md,
// "Authentication" and "What ferryd maps"). In process: real daemons on a
// unix socket and a mutual-TLS TCP port, real gRPC clients with and without
// certificates, real shared memory; a second uid (nobody) through the
// register_as helper, which drops root's privileges before it connects.
// Every refused call is checked for its status and for changing nothing,
// and the daemon is checked healthy afterwards.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "catch2/catch.hpp"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "tests/client/process_harness.h"
#include "tests/daemon/daemon_test_support.h"
#include "tests/daemon/test_certs.h"

namespace ferry {
namespace testing {
namespace {

std::chrono::system_clock::time_point In(int ms) {
  return std::chrono::system_clock::now() + std::chrono::milliseconds(ms);
}

std::string TcpTarget(const TestDaemon& d) {
  return absl::StrCat("127.0.0.1:", d.server->tcp_port());
}

// A TLS channel that trusts the cluster CA but presents no certificate.
std::shared_ptr<grpc::Channel> AnonymousTls(const std::string& target) {
  std::ifstream in(TestTls("operator").ca);
  std::stringstream ca;
  ca << in.rdbuf();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ca.str();
  return grpc::CreateChannel(target, grpc::SslCredentials(ssl));
}

int ParticipantCount(TestDaemon& d) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(5000));
  v1::ListParticipantsResponse r;
  REQUIRE(d.inspection->ListParticipants(&ctx, {}, &r).ok());
  return r.participants_size();
}

grpc::Status Health(const std::shared_ptr<grpc::Channel>& channel) {
  grpc::ClientContext ctx;
  ctx.set_deadline(In(5000));
  v1::GetHealthResponse h;
  return v1::Inspection::NewStub(channel)->GetHealth(&ctx, {}, &h);
}

int OpenFds() {
  int n = 0;
  DIR* dir = ::opendir("/proc/self/fd");
  while (dir != nullptr && ::readdir(dir) != nullptr) ++n;
  if (dir != nullptr) ::closedir(dir);
  return n;
}

// The local address (hex, as /proc/net/tcp writes it) a listening TCP
// socket of this machine binds on `port`; "" if none listens there.
std::string ListeningAddress(int port) {
  std::ifstream in("/proc/net/tcp");
  std::string line;
  std::getline(in, line);  // header
  while (std::getline(in, line)) {
    std::vector<std::string> f =
        absl::StrSplit(line, ' ', absl::SkipWhitespace());
    if (f.size() < 4 || f[3] != "0A") continue;  // LISTEN
    std::vector<std::string> local = absl::StrSplit(f[1], ':');
    int p = 0;
    if (local.size() == 2 && absl::SimpleHexAtoi(local[1], &p) && p == port) {
      return local[0];
    }
  }
  return "";
}

TEST_CASE("TCP callers without a cluster certificate change nothing",
          "[security]") {
  DaemonOptions o;
  o.node = "node-a";
  TestDaemon d(o);
  TrainerRank trainer(0, "policy");
  const std::string target = TcpTarget(d);

  SECTION("no client certificate: UNAUTHENTICATED on every service") {
    auto channel = AnonymousTls(target);
    grpc::Status health = Health(channel);
    CHECK(health.error_code() == grpc::StatusCode::UNAUTHENTICATED);
    CHECK(absl::StrContains(health.error_message(), "client certificate"));
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::RegisterSourceResponse r;
      CHECK(v1::Registry::NewStub(channel)
                ->RegisterSource(&ctx, trainer.Registration(), &r)
                .error_code() == grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::JoinCoordinatorRequest join;
      join.set_node("node-b");
      join.set_peer_address("127.0.0.1:1");
      v1::JoinCoordinatorResponse r;
      CHECK(v1::Peer::NewStub(channel)->JoinCoordinator(&ctx, join, &r)
                .error_code() == grpc::StatusCode::UNAUTHENTICATED);
    }
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::ListParticipantsResponse r;
      CHECK(v1::Inspection::NewStub(channel)
                ->ListParticipants(&ctx, {}, &r)
                .error_code() == grpc::StatusCode::UNAUTHENTICATED);
    }
  }
  SECTION("a certificate of another CA, or plain text: no connection") {
    CHECK_FALSE(Health(grpc::CreateChannel(
                           target, ChannelCredentialsOf(ForeignTls("node-b"))))
                    .ok());
    CHECK_FALSE(Health(grpc::CreateChannel(
                           target, grpc::InsecureChannelCredentials()))
                    .ok());
  }
  SECTION("a cluster certificate may inspect, but not register memory") {
    auto channel = TcpChannel(target, "operator");
    CHECK(Health(channel).ok());
    grpc::ClientContext ctx;
    ctx.set_deadline(In(5000));
    v1::RegisterSourceResponse r;
    grpc::Status s = v1::Registry::NewStub(channel)->RegisterSource(
        &ctx, trainer.Registration(), &r);
    CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(absl::StrContains(s.error_message(), "unix socket"));
  }
  CHECK(ParticipantCount(d) == 0);
  ExpectAnswers(d);
}

TEST_CASE("ferryd needs TLS for TCP, with its own node's certificate",
          "[security]") {
  DaemonOptions o;
  o.node = "node-a";
  o.socket_path = MakeTempDir() + "/s.sock";
  o.listen_address = "127.0.0.1:0";
  absl::StatusOr<std::unique_ptr<Server>> s = Server::Start(o);
  CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.status().message(), "--tls_cert"));
  o.tls = TestTls("node-b");  // someone else's
  s = Server::Start(o);
  CHECK(s.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(absl::StrContains(s.status().message(), "node-b"));
  // A key that others may read is refused.
  TlsFiles loose = TestTls("node-loose");
  REQUIRE(::chmod(loose.key.c_str(), 0644) == 0);
  o.node = "node-loose";
  o.tls = loose;
  s = Server::Start(o);
  CHECK(s.status().code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(::chmod(loose.key.c_str(), 0600) == 0);
}

TEST_CASE("the Peer service is not served on the unix socket", "[security]") {
  DaemonOptions o;
  o.node = "node-a";
  TestDaemon d(o);
  auto peer = v1::Peer::NewStub(d.channel);
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(5000));
    v1::JoinCoordinatorRequest join;
    join.set_node("node-b");
    join.set_peer_address("127.0.0.1:1");
    v1::JoinCoordinatorResponse r;
    grpc::Status s = peer->JoinCoordinator(&ctx, join, &r);
    CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(absl::StrContains(s.error_message(), "not served on the unix"));
  }
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(5000));
    v1::OpenChannelRequest open;
    open.set_caller_node("node-b");
    open.set_channel_id("node-b->node-a");
    open.set_epoch(1);
    open.mutable_tcp()->set_connection_count(1);
    v1::OpenChannelResponse r;
    CHECK(peer->OpenChannel(&ctx, open, &r).error_code() ==
          grpc::StatusCode::PERMISSION_DENIED);
  }
  ExpectAnswers(d);
}

TEST_CASE("a member acts only as the node its certificate names",
          "[security]") {
  TwoNodes nodes;
  TrainerRank trainer(0, "policy");
  RegisterSource(nodes.b, trainer);  // through the member
  REQUIRE(ParticipantCount(nodes.a) == 1);
  const std::string a = TcpTarget(nodes.a), b = TcpTarget(nodes.b);

  SECTION("another member's name cannot be taken over") {
    grpc::ClientContext ctx;
    ctx.set_deadline(In(5000));
    v1::JoinCoordinatorRequest join;
    join.set_node("node-b");
    join.set_peer_address("127.0.0.1:1");
    join.set_replace_existing(true);
    v1::JoinCoordinatorResponse r;
    grpc::Status s = v1::Peer::NewStub(TcpChannel(a, "node-c"))
                         ->JoinCoordinator(&ctx, join, &r);
    CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(absl::StrContains(s.error_message(), "node-c"));
    // node-b is still a member, with its participant.
    grpc::ClientContext hctx;
    v1::GetHealthResponse h;
    REQUIRE(nodes.a.inspection->GetHealth(&hctx, {}, &h).ok());
    REQUIRE(h.peers_size() == 1);
    CHECK(h.peers(0).node() == "node-b");
    CHECK(h.peers(0).reachable());
    CHECK(ParticipantCount(nodes.a) == 1);
  }
  SECTION("send work comes only from the coordinator the member joined") {
    v1::RunTransferRequest run;
    run.set_role("send");
    run.set_peer_node("node-c");
    run.set_peer_address("127.0.0.1:9");  // where it would connect
    for (const char* as : {"node-c", "operator"}) {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::RunTransferResponse r;
      grpc::Status s =
          v1::Peer::NewStub(TcpChannel(b, as))->RunTransfer(&ctx, run, &r);
      INFO(as << ": " << s.error_message());
      CHECK(s.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    }
    grpc::ClientContext ctx;
    ctx.set_deadline(In(5000));
    v1::RunTransferResponse r;
    CHECK(v1::Peer::NewStub(TcpChannel(a, "node-b"))
              ->RunTransfer(&ctx, run, &r)
              .error_code() == grpc::StatusCode::PERMISSION_DENIED);
    // Checksums of memory a member maps, likewise.
    grpc::ClientContext hctx;
    hctx.set_deadline(In(5000));
    v1::HashBoxesResponse hashed;
    CHECK(v1::Peer::NewStub(TcpChannel(b, "node-c"))
              ->HashBoxes(&hctx, v1::HashBoxesRequest(), &hashed)
              .error_code() == grpc::StatusCode::PERMISSION_DENIED);
    // Block maxima of a member's trainer memory (FP8 in flight), likewise.
    grpc::ClientContext actx;
    actx.set_deadline(In(5000));
    v1::BlockAmaxRequest ask;
    ask.mutable_order()->set_quantizer_id("quantizer.policy.node-b");
    v1::BlockAmaxResponse maxima;
    grpc::Status denied = v1::Peer::NewStub(TcpChannel(b, "node-c"))
                              ->BlockAmax(&actx, ask, &maxima);
    CHECK(denied.error_code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(absl::StrContains(denied.error_message(), "BlockAmax is taken only "
                                                    "from the coordinator"));
  }
  SECTION("HashBoxes from the coordinator is still bounded and checked") {
    // Garbage from the one caller HashBoxes trusts: refused by the request
    // limits (or the bounds check), never hashed, never read out of bounds.
    auto as_a = v1::Peer::NewStub(TcpChannel(b, "node-a"));
    auto call = [&](const v1::HashBoxesRequest& req) {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(10000));
      v1::HashBoxesResponse r;
      return as_a->HashBoxes(&ctx, req, &r);
    };
    v1::HashBoxesRequest many;
    for (int i = 0; i < 32769; ++i) many.add_boxes()->set_unit_bytes(1);
    grpc::Status s = call(many);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(absl::StrContains(s.error_message(), "at most 32768"));

    v1::HashBoxesRequest deep;
    v1::TransferBox* box = deep.add_boxes();
    for (int d = 0; d < 9; ++d) {
      box->add_extent(1);
      box->add_strides(1);
    }
    s = call(deep);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(absl::StrContains(s.error_message(), "boxes[0].extent"));

    v1::HashBoxesRequest long_id;
    long_id.add_boxes()->set_participant_id(std::string(1 << 16, 'p'));
    s = call(long_id);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().size() < 2000);

    // Within the limits: a participant this member does not map.
    v1::HashBoxesRequest unknown;
    unknown.add_boxes()->set_participant_id("dst.nobody.0.0001");
    s = call(unknown);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);

    // A box past the end of memory the member does map: refused whole.
    v1::HashBoxesRequest past;
    v1::TransferBox* over = past.add_boxes();
    over->set_participant_id(trainer.handle.participant_id());
    over->set_buffer(0);
    over->add_extent(int64_t{1} << 30);
    over->add_strides(1);
    over->set_unit_bytes(4);
    s = call(past);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(absl::StrContains(s.error_message(), "outside the buffer"));
  }
  SECTION("a channel is opened only as oneself, and not without bound") {
    v1::OpenChannelRequest open;
    open.set_caller_node("node-a");
    open.set_epoch(1);
    open.mutable_tcp()->set_connection_count(1);
    {
      open.set_channel_id("node-a->spoof");
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::OpenChannelResponse r;
      CHECK(v1::Peer::NewStub(TcpChannel(b, "node-c"))
                ->OpenChannel(&ctx, open, &r)
                .error_code() == grpc::StatusCode::PERMISSION_DENIED);
    }
    auto as_a = v1::Peer::NewStub(TcpChannel(b, "node-a"));
    const int fds_before = OpenFds();
    int opened = 0, exhausted = 0, first_port = 0;
    for (int i = 0; i < 200; ++i) {
      open.set_channel_id(absl::StrCat("node-a->flood-", i));
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::OpenChannelResponse r;
      grpc::Status s = as_a->OpenChannel(&ctx, open, &r);
      if (s.ok()) {
        ++opened;
        if (first_port == 0) {
          std::vector<std::string> hp = absl::StrSplit(r.tcp().address(), ':');
          REQUIRE(hp.size() == 2);
          REQUIRE(absl::SimpleAtoi(hp[1], &first_port));
        }
      } else if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        ++exhausted;
      }
    }
    CHECK(opened <= 40);  // per peer: 16 rails twice, and a few more
    CHECK(opened + exhausted == 200);
    CHECK(OpenFds() - fds_before <= opened + 8);
    {
      // A rail the daemon does not have (it has one, no --rails).
      v1::OpenChannelRequest rail = open;
      rail.set_channel_id("node-a->rail-x");
      rail.mutable_tcp()->set_rail(3);
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::OpenChannelResponse r;
      const grpc::Status s = as_a->OpenChannel(&ctx, rail, &r);
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(s.error_message() == "OpenChannel: rail 3 of node node-b, which has 1 rail");
    }
    {
      // A route's rail channels: each must be open, none named twice, at
      // most 16 in all; refused before any byte is awaited.
      v1::RunTransferRequest run;
      run.set_caller_node("node-a");
      run.set_channel_id("node-a->flood-0");
      run.set_channel_epoch(1);
      run.set_timeout_ms(2000);
      auto call = [&](const v1::RunTransferRequest& req) {
        grpc::ClientContext ctx;
        ctx.set_deadline(In(5000));
        v1::RunTransferResponse r;
        return as_a->RunTransfer(&ctx, req, &r);
      };
      v1::RunTransferRequest unknown = run;
      v1::RailChannel* rail = unknown.add_rail_channels();
      rail->set_channel_id("node-a->never-opened");
      rail->set_epoch(1);
      grpc::Status s = call(unknown);
      CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
      CHECK(s.error_message() ==
            "RunTransfer: no channel node-a->never-opened at epoch 1 (open "
            "it with OpenChannel)");
      v1::RunTransferRequest twice = run;
      rail = twice.add_rail_channels();
      rail->set_channel_id("node-a->flood-0");
      rail->set_epoch(1);
      s = call(twice);
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(s.error_message() ==
            "RunTransfer: channel node-a->flood-0 named twice");
      v1::RunTransferRequest many = run;
      for (int i = 1; i <= 16; ++i) {
        rail = many.add_rail_channels();
        rail->set_channel_id(absl::StrCat("node-a->flood-", i));
        rail->set_epoch(1);
      }
      s = call(many);
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(s.error_message() ==
            "RunTransfer: 17 channels for one route (at most 16)");
    }
    // The channel listener binds --listen's host (127.0.0.1), not 0.0.0.0.
    CHECK(ListeningAddress(first_port) == "0100007F");
  }
  SECTION("a UCX channel's request is bounded too") {
    v1::OpenChannelRequest open;
    open.set_caller_node("node-a");
    open.set_channel_id("node-a->ucx");
    open.set_epoch(1);
    open.mutable_ucx()->set_transports(std::string(300, 'x'));
    auto as_a = v1::Peer::NewStub(TcpChannel(b, "node-a"));
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::OpenChannelResponse r;
      grpc::Status s = as_a->OpenChannel(&ctx, open, &r);
      INFO(s.error_message());
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(absl::StrContains(s.error_message(), "transports of 300 bytes"));
    }
    // A caller's list it does not share only shows in messages: the
    // callee listens with its own transports (UCX's default here).
    open.mutable_ucx()->set_transports("no-such-transport");
    int opened = 0, exhausted = 0;
    for (int i = 0; i < 60; ++i) {
      open.set_channel_id(absl::StrCat("node-a->ucx-", i));
      grpc::ClientContext ctx;
      ctx.set_deadline(In(5000));
      v1::OpenChannelResponse r;
      grpc::Status s = as_a->OpenChannel(&ctx, open, &r);
      INFO(s.error_message());
      if (s.ok()) {
        ++opened;
        CHECK(!r.tcp().address().empty());
        CHECK(!r.tcp().connection_token().empty());
      } else {
        CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
        ++exhausted;
      }
    }
    // At most 40 from one peer: 16 rails, twice, and a few more.
    CHECK(opened == 40);
    CHECK(exhausted == 20);
  }
  ExpectAnswers(nodes.a);
  ExpectAnswers(nodes.b);
}

// Runs register_as as nobody against `d`, with `request` serialized.
std::string RegisterAsNobody(const TestDaemon& d,
                             const google::protobuf::Message& request,
                             bool destination, int64_t own_shm_bytes = 0) {
  const std::string file = d.dir + "/request.bin";
  {
    std::ofstream out(file, std::ios::binary);
    REQUIRE(request.SerializeToOstream(&out));
  }
  REQUIRE(::chmod(file.c_str(), 0644) == 0);
  const std::string out = d.dir + "/register_as.out";
  const std::string cmd = absl::StrCat(
      Runfile("tests/security/register_as"), " --uid=65534 --gid=65534",
      " --socket=", d.options.socket_path, " --request=", file,
      destination ? " --destination" : "",
      own_shm_bytes > 0 ? absl::StrCat(" --own_shm_bytes=", own_shm_bytes)
                        : std::string(),
      " >", out, " 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream in(out);
  std::stringstream text;
  text << in.rdbuf();
  INFO(cmd << "\n" << text.str());
  REQUIRE(rc == 0);
  return text.str();
}

TEST_CASE("a second uid cannot make ferryd map memory it could not open",
          "[security]") {
  if (::geteuid() != 0) {
    WARN("SKIPPED: needs root (to run a second uid against ferryd)");
    return;
  }
  DaemonOptions o;
  o.client_uids = "all";  // a node shared by several users
  TestDaemon d(o);
  REQUIRE(::chmod(d.dir.c_str(), 0711) == 0);  // let nobody reach run/

  // Root's secret, mode 0600, and a sealed memfd of this (root) process.
  TrainerRank secret_holder(0, "policy");
  const std::string secret = secret_holder.memory->name();
  absl::StatusOr<SharedMemoryRegion> memfd =
      SharedMemoryRegion::CreateMemfd(secret_holder.memory->size());
  REQUIRE(memfd.ok());

  SECTION("a root-only shm object, as a source or a destination") {
    v1::RegisterSourceRequest src = secret_holder.Registration();
    std::string said = RegisterAsNobody(d, src, false);
    CHECK(absl::StartsWith(said, "7 "));  // PERMISSION_DENIED
    CHECK(absl::StrContains(said, "may not read"));
    EngineRank engine("vllm-0", 0, "policy");
    v1::RegisterDestinationRequest dst = engine.Registration();
    said = RegisterAsNobody(d, dst, true);
    CHECK(absl::StartsWith(said, "7 "));
    CHECK(absl::StrContains(said, "may not write"));
  }
  SECTION("another user's memfd through /proc/<pid>/fd") {
    v1::RegisterSourceRequest src = secret_holder.Registration();
    v1::SharedMemoryRegion* shm =
        src.mutable_source()->mutable_regions(0)->mutable_shared_memory();
    std::vector<std::string> parts = absl::StrSplit(memfd->name(), '/');
    int fd = -1;
    REQUIRE(absl::SimpleAtoi(parts.back(), &fd));
    shm->mutable_memfd()->set_pid(::getpid());
    shm->mutable_memfd()->set_fd(fd);
    const std::string said = RegisterAsNobody(d, src, false);
    CHECK(absl::StartsWith(said, "7 "));
    CHECK(absl::StrContains(said, "not one of the caller's"));
  }
  SECTION("a root-only checkpoint file as a file_path region") {
    const std::string file = d.dir + "/secret.safetensors";
    {
      std::ofstream out(file, std::ios::binary);
      out << std::string(4096, 's');
    }
    REQUIRE(::chmod(file.c_str(), 0644) == 0);  // readable, but root's
    v1::RegisterSourceRequest src = secret_holder.Registration();
    src.mutable_source()->mutable_regions(0)->mutable_shared_memory()
        ->set_file_path(file);
    const std::string said = RegisterAsNobody(d, src, false);
    CHECK(absl::StartsWith(said, "7 "));
    CHECK(absl::StrContains(said, "does not belong to the caller"));
  }
  CHECK(ParticipantCount(d) == 0);
  SECTION("another user's instance cannot be changed") {
    // Every Lifecycle call that changes an instance (docs/api.md,
    // "Authentication"), each refused before it touches the instance.
    EngineRank engine("roots", 0, "policy");
    RegisterDestination(d, engine);
    for (const char* rpc : {"ReloadInPlace", "Offload", "Onload", "LoadAdapter",
                            "UnloadAdapter", "UpdateConfig"}) {
      INFO(rpc);
      const std::string out = d.dir + "/lifecycle.out";
      const std::string cmd = absl::StrCat(
          Runfile("tests/security/register_as"), " --uid=65534 --gid=65534",
          " --socket=", d.options.socket_path, " --instance=roots",
          " --lifecycle=", rpc, " >", out, " 2>&1");
      REQUIRE(std::system(cmd.c_str()) == 0);
      std::ifstream in(out);
      std::stringstream said;
      said << in.rdbuf();
      INFO(said.str());
      CHECK(absl::StartsWith(said.str(), "7 "));  // PERMISSION_DENIED
      CHECK(absl::StrContains(said.str(), "may change only its own instances"));
      CHECK(absl::StrContains(said.str(), std::string(rpc) + "(roots)"));
    }
  }
  SECTION("its own memory is mapped (the honest case)") {
    const std::string said = RegisterAsNobody(
        d, secret_holder.Registration(), false, secret_holder.memory->size());
    CHECK(absl::StartsWith(said, "0 "));
  }
  ExpectAnswers(d);
}

TEST_CASE("a client that shrinks its memory aborts its version, not ferryd",
          "[security]") {
  // On one node the local copy engine faults; across nodes the TCP
  // channel's pack (source) or unpack (destination) on either daemon.
  const bool across_nodes = GENERATE(false, true);
  INFO((across_nodes ? "trainer on node-a, engine on node-b" : "one node"));
  std::unique_ptr<TestDaemon> one;
  std::unique_ptr<TwoNodes> two;
  if (across_nodes) {
    two = std::make_unique<TwoNodes>();
  } else {
    one = std::make_unique<TestDaemon>();
  }
  TestDaemon& d = across_nodes ? two->a : *one;
  TestDaemon& engine_daemon = across_nodes ? two->b : *one;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    RegisterSource(d, *trainers.back());
  }
  std::vector<std::unique_ptr<EngineRank>> engines;
  std::vector<EngineRank*> ranks;
  for (int r = 0; r < 4; ++r) {
    engines.push_back(std::make_unique<EngineRank>("vllm-0", r, "policy"));
    engines.back()->lm_head_direct = true;
    RegisterDestination(engine_daemon, *engines.back());
    engines.back()->Run(engine_daemon.versions.get());
    ranks.push_back(engines.back().get());
  }
  ExpectVersionCommits(d, {trainers[0].get(), trainers[1].get()}, ranks, 1, 1);

  const bool shrink_source = GENERATE(true, false);
  INFO((shrink_source ? "source" : "destination") << " shrinks");
  if (shrink_source) {
    Shrink(*trainers[1]->memory);
  } else {
    Shrink(*engines[2]->memory);
  }
  // Version 2 aborts, naming the participant and region whose memory went.
  for (int r = 0; r < 2; ++r) {
    if (!(shrink_source && r == 1)) trainers[r]->Fill(2);
  }
  std::vector<grpc::Status> results(2);
  std::vector<v1::CommitVersionResponse> responses(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      grpc::ClientContext bctx;
      bctx.set_deadline(In(20000));
      v1::BeginVersionRequest begin;
      *begin.mutable_handle() = trainers[r]->handle;
      begin.set_version(2);
      v1::BeginVersionResponse bresp;
      results[r] = d.versions->BeginVersion(&bctx, begin, &bresp);
      if (!results[r].ok()) return;
      grpc::ClientContext cctx;
      cctx.set_deadline(In(30000));
      v1::CommitVersionRequest commit;
      *commit.mutable_handle() = trainers[r]->handle;
      commit.set_version(2);
      results[r] = d.versions->CommitVersion(&cctx, commit, &responses[r]);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO(results[r].error_message());
    REQUIRE(results[r].ok());
    REQUIRE(responses[r].instances_size() == 1);
    const v1::InstanceStatus& st = responses[r].instances(0);
    CHECK(st.state() == v1::INSTANCE_STATE_ABORTED);
    CHECK(st.committed_version() == 1);
    INFO(st.abort_reason());
    CHECK(absl::StrContains(st.abort_reason(), "no longer backed"));
    CHECK(absl::StrContains(st.abort_reason(),
                            shrink_source ? "source policy rank 1"
                                          : "tp rank 2"));
    CHECK(absl::StrContains(st.abort_reason(), "region 0"));
  }
  ExpectAnswers(d);
  ExpectAnswers(engine_daemon);
  for (auto& e : engines) e->Stop();
}

TEST_CASE("a sparse region larger than the free /dev/shm is refused",
          "[security]") {
  TestDaemon d;
  struct statvfs fs;
  REQUIRE(::statvfs("/dev/shm", &fs) == 0);
  const int64_t free_bytes =
      static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_frsize);
  TrainerRank trainer(0, "policy");
  const std::string name = absl::StrCat("/ferry-test-sparse-", ::getpid());
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
  REQUIRE(fd >= 0);
  const int64_t bytes = free_bytes + (int64_t{1} << 30);
  REQUIRE(::ftruncate(fd, bytes) == 0);  // holes only: takes no memory
  ::close(fd);
  v1::RegisterSourceRequest req = trainer.Registration();
  v1::MemoryRegion* region = req.mutable_source()->mutable_regions(0);
  region->mutable_shared_memory()->set_shm_name(name);
  region->set_size_bytes(bytes);
  grpc::ClientContext ctx;
  ctx.set_deadline(In(10000));
  v1::RegisterSourceResponse r;
  grpc::Status s = d.registry->RegisterSource(&ctx, req, &r);
  ::shm_unlink(name.c_str());
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(absl::StrContains(s.error_message(), "sparse"));
  CHECK(ParticipantCount(d) == 0);
  ExpectAnswers(d);
}

}  // namespace
}  // namespace testing
}  // namespace ferry
