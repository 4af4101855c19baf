// The client library's own checks, which need no daemon: addresses, the
// shared tensor arena, and registrations the daemon would reject, caught
// before any RPC with a message naming the rank, parameter and box.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <string>

#include "client/connection.h"
#include "client/destination_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"

namespace ferry {
namespace {

TEST_CASE("daemon addresses: default socket and normalization") {
  setenv("FERRY_SOCKET", "/run/x/ferryd.sock", 1);
  CHECK(DefaultSocketPath() == "/run/x/ferryd.sock");
  CHECK(NormalizeDaemonAddress("") == "unix:/run/x/ferryd.sock");
  unsetenv("FERRY_SOCKET");
  setenv("XDG_RUNTIME_DIR", "/run/user/7", 1);
  CHECK(DefaultSocketPath() == "/run/user/7/ferry/ferryd.sock");
  unsetenv("XDG_RUNTIME_DIR");
  CHECK(DefaultSocketPath() ==
        "/tmp/ferry-" + std::to_string(getuid()) + "/ferryd.sock");
  CHECK(NormalizeDaemonAddress("/tmp/f.sock") == "unix:/tmp/f.sock");
  CHECK(NormalizeDaemonAddress("unix:/tmp/f.sock") == "unix:/tmp/f.sock");
  CHECK(NormalizeDaemonAddress("node-a:7070") == "node-a:7070");
}

TEST_CASE("arena slots are 256-byte aligned and bounded") {
  auto arena = SharedTensorArena::Create("test.arena", 4096, 3);
  REQUIRE(arena.ok());
  auto a = (*arena)->Allocate(10);
  auto b = (*arena)->Allocate(300);
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  CHECK(a->byte_offset == 0);
  CHECK(b->byte_offset == 256);
  CHECK(b->data == (*arena)->data() + 256);
  CHECK((*arena)->used() == 556);
  auto full = (*arena)->Allocate(4096);
  REQUIRE_FALSE(full.ok());
  CHECK(full.status().code() == absl::StatusCode::kResourceExhausted);

  const v1::MemoryRegion r = (*arena)->Describe();
  CHECK(r.region_id() == 3u);
  CHECK(r.size_bytes() == 4096);
  CHECK(r.shared_memory().shm_name() == (*arena)->os_name());
  CHECK(r.shared_memory().shm_name().rfind("/ferry-", 0) == 0);

  CHECK(SharedTensorArena::Create("x", 0, 0).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(SharedTensorArena::Create("x", 64, 0x80000001u).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("a memfd arena describes itself by pid and fd") {
  auto arena = SharedTensorArena::Create("m", 8192, 0,
                                         SharedTensorArena::Backing::kMemfd);
  REQUIRE(arena.ok());
  const v1::MemoryRegion r = (*arena)->Describe();
  REQUIRE(r.shared_memory().has_memfd());
  CHECK(r.shared_memory().memfd().pid() == getpid());
  CHECK(r.shared_memory().memfd().fd() >= 0);
}

struct SourceFixture {
  SourceOptions options;
  SourceLayout layout;
  SourceFixture() {
    options.stream = "policy";
    options.rank = 1;
    options.world_size = 2;
    layout.model.params.push_back(
        {"model.layers.0.mlp.down_proj.weight", DType::kBF16, Dims{64, 128}});
    layout.model.BuildIndex();
    // Rank 1 holds columns [64, 128) of the row-parallel weight.
    layout.pieces.push_back(
        Piece::Contiguous(0, Box{{0, 64}, {64, 64}}, 0, 0, DType::kBF16));
    v1::MemoryRegion region;
    region.set_region_id(0);
    region.set_size_bytes(64 * 64 * 2);
    region.mutable_shared_memory()->set_shm_name("/ferry-test");
    layout.regions.push_back(region);
  }
};

TEST_CASE("source registrations: valid one passes") {
  SourceFixture f;
  CHECK(ValidateSourceRegistration(f.options, f.layout).ok());
  auto wire = BuildSourceRegistration(f.options, f.layout);
  REQUIRE(wire.ok());
  CHECK(wire->pieces(0).parameter() == "model.layers.0.mlp.down_proj.weight");
  CHECK(wire->pid() == getpid());
  CHECK(wire->device().kind() == v1::DEVICE_KIND_HOST);
}

TEST_CASE("source registrations: malformed input is INVALID_ARGUMENT, named") {
  SourceFixture f;
  SECTION("stream name") {
    f.options.stream = "policy/v2";
    CHECK(ValidateSourceRegistration(f.options, f.layout).message() ==
          "stream 'policy/v2' has character '/'; allowed: [A-Za-z0-9._-]");
  }
  SECTION("rank outside world") {
    f.options.rank = 2;
    CHECK(ValidateSourceRegistration(f.options, f.layout).message() ==
          "source policy rank 2: rank 2 is outside [0, 2)");
  }
  SECTION("piece past the end of its region") {
    f.layout.regions[0].set_size_bytes(4096);
    CHECK(ValidateSourceRegistration(f.options, f.layout).message() ==
          "source policy rank 1: piece of model.layers.0.mlp.down_proj.weight "
          "box [0:64, 64:128] ends at byte 8192, past the end of region 0 "
          "(4096 bytes)");
  }
  SECTION("box outside the parameter") {
    f.layout.pieces[0].box.offset[1] = 100;
    const absl::Status s = ValidateSourceRegistration(f.options, f.layout);
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK_THAT(std::string(s.message()),
               Catch::StartsWith("source policy rank 1: piece of "
                                 "model.layers.0.mlp.down_proj.weight box "
                                 "[0:64, 100:164] is not inside its shape "
                                 "[64, 128]"));
  }
  SECTION("unregistered region") {
    f.layout.pieces[0].buffer = 9;
    CHECK_THAT(std::string(ValidateSourceRegistration(f.options, f.layout).message()),
               Catch::EndsWith("is in region 9, which is not registered"));
  }
  SECTION("staging region id") {
    f.layout.regions[0].set_region_id(0x80000000u);
    CHECK_THAT(std::string(ValidateSourceRegistration(f.options, f.layout).message()),
               Catch::Contains("top bit set"));
  }
  SECTION("duplicate region") {
    f.layout.regions.push_back(f.layout.regions[0]);
    CHECK(ValidateSourceRegistration(f.options, f.layout).message() ==
          "source policy rank 1: region id 0 is registered twice");
  }
  SECTION("region without memory") {
    f.layout.regions[0].clear_shared_memory();
    CHECK_THAT(std::string(ValidateSourceRegistration(f.options, f.layout).message()),
               Catch::Contains("names no memory"));
  }
  SECTION("parameter without dtype") {
    f.layout.model.params[0].dtype = DType::kInvalid;
    CHECK(ValidateSourceRegistration(f.options, f.layout).message() ==
          "source policy rank 1: parameter "
          "'model.layers.0.mlp.down_proj.weight' has no dtype");
  }
  SECTION("Register fails the same way, before any RPC") {
    f.options.world_size = 0;
    ConnectionOptions c;
    c.address = "unix:/nonexistent/ferryd.sock";
    auto connection = Connection::Open(c);
    REQUIRE(connection.ok());
    auto client = SourceClient::Register(*connection, f.options, f.layout);
    REQUIRE_FALSE(client.ok());
    CHECK(client.status().message() ==
          "source policy rank 1: world_size 0 must be >= 1");
  }
}

TEST_CASE("registering with no daemon fails within the deadline") {
  SourceFixture f;
  ConnectionOptions c;
  c.address = "unix:/nonexistent/ferryd.sock";
  c.rpc_timeout = absl::Milliseconds(300);
  auto connection = Connection::Open(c);
  REQUIRE(connection.ok());
  const absl::Time start = absl::Now();
  auto client = SourceClient::Register(*connection, f.options, f.layout);
  REQUIRE_FALSE(client.ok());
  CHECK((client.status().code() == absl::StatusCode::kUnavailable ||
         client.status().code() == absl::StatusCode::kDeadlineExceeded));
  CHECK_THAT(std::string(client.status().message()),
             Catch::StartsWith("RegisterSource(source policy rank 1): "));
  CHECK(absl::Now() - start < absl::Seconds(5));
  CHECK(connection->WaitForReady(absl::Milliseconds(100)).code() ==
        absl::StatusCode::kUnavailable);
}

TEST_CASE("destination registrations: malformed input is INVALID_ARGUMENT") {
  DestinationOptions o;
  o.instance_id = "vllm-0";
  o.stream = "policy";
  o.tp_rank = 0;
  o.tp_size = 2;
  EngineTable table;
  EngineParam p;
  p.name = "model.norm.weight";
  p.dtype = DType::kBF16;
  p.local_shape = {1024};
  p.loader = LoaderKind::kReplicated;
  p.tp_size = 2;
  table.params.push_back(p);
  v1::MemoryRegion region;
  region.set_region_id(0);
  region.set_size_bytes(2048);
  region.mutable_shared_memory()->set_shm_name("/ferry-test");
  DestinationLayout layout = DestinationLayout::FromEngineTable(table, {region});
  CHECK(ValidateDestinationRegistration(o, layout).ok());

  SECTION("tp rank") {
    o.tp_rank = 2;
    CHECK(ValidateDestinationRegistration(o, layout).message() ==
          "instance vllm-0 tp rank 2: tp_rank 2 is outside [0, 2)");
  }
  SECTION("instance id") {
    o.instance_id = "";
    CHECK_THAT(std::string(ValidateDestinationRegistration(o, layout).message()),
               Catch::StartsWith("instance_id '' must be 1 to 128"));
  }
  SECTION("parameter outside its region") {
    layout.engine_table->params[0].byte_offset = 1024;
    CHECK(ValidateDestinationRegistration(o, layout).message() ==
          "instance vllm-0 tp rank 0: engine parameter model.norm.weight at "
          "byte 1024 (2048 bytes) is not inside region 0 (2048 bytes)");
  }
  SECTION("duplicate parameter") {
    layout.engine_table->params.push_back(layout.engine_table->params[0]);
    CHECK(ValidateDestinationRegistration(o, layout).message() ==
          "instance vllm-0 tp rank 0: engine parameter model.norm.weight "
          "appears twice");
  }
  SECTION("no layout at all") {
    DestinationLayout empty;
    empty.regions = {region};
    CHECK_THAT(std::string(ValidateDestinationRegistration(o, empty).message()),
               Catch::EndsWith("neither an engine table nor explicit pieces"));
  }
  SECTION("explicit pieces are checked like a source's") {
    ModelSpec m;
    m.params.push_back({"model.norm.weight", DType::kBF16, Dims{1024}});
    m.BuildIndex();
    DestinationLayout pieces = DestinationLayout::FromPieces(
        m, {Piece::Contiguous(0, Box{{0}, {1024}}, 0, 256, DType::kBF16)},
        {region});
    CHECK(ValidateDestinationRegistration(o, pieces).message() ==
          "instance vllm-0 tp rank 0: piece of model.norm.weight box [0:1024] "
          "ends at byte 2304, past the end of region 0 (2048 bytes)");
    auto wire = BuildDestinationRegistration(o, DestinationLayout::FromPieces(
        m, {Piece::Contiguous(0, Box{{0}, {1024}}, 0, 0, DType::kBF16)},
        {region}));
    REQUIRE(wire.ok());
    CHECK(wire->explicit_pieces().pieces_size() == 1);
  }
}

}  // namespace
}  // namespace ferry
