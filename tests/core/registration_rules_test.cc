// core/registration_rules.h: the one definition of what a rank's regions
// and pieces must be, which the client libraries and the daemon both run
// (tests/client/client_validation_test.cc and
// tests/daemon/protocol_errors_test.cc check that each says it).
#include "core/registration_rules.h"

#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "core/registration.h"

namespace ferry {
namespace {

ModelSpec Model() {
  ModelSpec m;
  m.params.push_back({"w", DType::kF32, Dims{4, 8}});
  m.BuildIndex();
  return m;
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST_CASE("CheckRegions: ids unique and below 2^31, sizes > 0, memory named") {
  CHECK(Message(CheckRegions("r", {{1, 8, true}, {1, 8, true}}).status()) ==
        "r: region id 1 is registered twice");
  CHECK(Message(CheckRegions("r", {{0x80000001u, 8, true}}).status())
            .find("top bit set") != std::string::npos);
  CHECK(Message(CheckRegions("r", {{2, 0, true}}).status()) ==
        "r: region 2 has size_bytes 0; it must be > 0");
  CHECK(Message(CheckRegions("r", {{3, 8, false}}).status()) ==
        "r: region 3 names no memory (shared_memory or cuda_ipc)");
  // Sorted by id: the buffer order the daemon maps them in.
  absl::StatusOr<std::vector<RegionDecl>> ok =
      CheckRegions("r", {{9, 64, true}, {2, 256, true}});
  REQUIRE(ok.ok());
  CHECK((*ok)[0].id == 2);
  CHECK((*ok)[1].id == 9);
}

TEST_CASE("PlacePieces: dense buffers, default strides, bounds by region id") {
  const ModelSpec m = Model();
  const std::vector<RegionDecl> regions = {{2, 64, true}, {9, 128, true}};
  Piece p;
  p.param = 0;
  p.box = Box{{0, 0}, {2, 8}};  // 64 bytes of F32
  p.buffer = 9;
  p.byte_offset = 64;
  absl::StatusOr<RankLayout> placed = PlacePieces("rank 0", m, regions, {p});
  REQUIRE(placed.ok());
  CHECK(placed->pieces[0].buffer == 1);  // region 9 is the second buffer
  CHECK(placed->pieces[0].strides == Dims{8, 1});

  p.byte_offset = 100;  // ends at 164 > 128
  CHECK(Message(PlacePieces("rank 0", m, regions, {p}).status()) ==
        "rank 0: piece of w box [0:2, 0:8] ends at byte 164, past the end of "
        "region 9 (128 bytes)");
  p.buffer = 5;
  CHECK(Message(PlacePieces("rank 0", m, regions, {p}).status()) ==
        "rank 0: piece of w box [0:2, 0:8] is in region 5, which is not "
        "registered");
  p.buffer = 2;
  p.byte_offset = 0;
  p.box = Box{{3, 0}, {2, 8}};
  CHECK(Message(PlacePieces("rank 0", m, regions, {p}).status())
            .rfind("rank 0: piece of w box [3:5, 0:8] is not inside its "
                   "shape [4, 8]",
                   0) == 0);
  p.box = Box{{0, 0}, {1, 8}};
  p.strides = {8, -1};
  CHECK(Message(PlacePieces("rank 0", m, regions, {p}).status()) ==
        "rank 0: piece of w box [0:1, 0:8]: stride -1 of dim 1 is negative");
}

// A trainer rank of stream "policy" holding all of Model()'s `w` in
// region 7 (128 bytes).
SourceRegistration Trainer() {
  SourceRegistration r;
  r.stream = "policy";
  r.node = "node-a";
  r.rank = 0;
  r.world_size = 1;
  r.pid = 42;
  r.model = std::make_shared<const ModelSpec>(Model());
  r.regions = {{7, 128, true}};
  Piece p;
  p.param = 0;
  p.box = Box{{0, 0}, {4, 8}};
  p.buffer = 7;
  r.pieces = {p};
  return r;
}

TEST_CASE("CheckSourceRegistration: the whole trainer rank, its pieces "
          "placed in place") {
  SourceRegistration r = Trainer();
  REQUIRE(CheckSourceRegistration(&r, "node-a").ok());
  CHECK(r.pieces[0].buffer == 0);  // region 7 is the only buffer
  CHECK(r.pieces[0].strides == Dims{8, 1});

  r = Trainer();  // the client does not know the daemon's node
  CHECK(CheckSourceRegistration(&r).ok());
  r = Trainer();
  CHECK(Message(CheckSourceRegistration(&r, "node-b")) ==
        "source policy rank 0: registered with the daemon of node node-b but "
        "says it runs on node node-a; register with the ferryd on your own "
        "node");
  r = Trainer();
  r.world_size = 65537;
  CHECK(Message(CheckSourceRegistration(&r)) ==
        "source policy rank 0: world_size 65537 is more than 65536 ranks");
  r = Trainer();
  r.rank = 1;
  CHECK(Message(CheckSourceRegistration(&r)) ==
        "source policy rank 1: rank 1 is outside [0, 1)");
  r = Trainer();
  r.pid = -1;
  CHECK(Message(CheckSourceRegistration(&r)) ==
        "source policy rank 0: pid -1 is negative");
  r = Trainer();
  r.regions = {{7, 64, true}};
  CHECK(Message(CheckSourceRegistration(&r)) ==
        "source policy rank 0: piece of w box [0:4, 0:8] ends at byte 128, "
        "past the end of region 7 (64 bytes)");
}

// An engine rank of instance "vllm-0" with two F32 [2, 8] parameters (64
// bytes each) side by side in region 1 (128 bytes).
DestinationRegistration Engine() {
  DestinationRegistration r;
  r.instance_id = "vllm-0";
  r.stream = "policy";
  r.tp_rank = 0;
  r.tp_size = 1;
  r.regions = {{1, 128, true}};
  r.layout = DestinationRegistration::Layout::kEngineTable;
  EngineParam a;
  a.name = "a";
  a.dtype = DType::kF32;
  a.local_shape = {2, 8};
  a.buffer = 1;
  EngineParam b = a;
  b.name = "b";
  b.byte_offset = 64;
  r.engine_params = {a, b};
  return r;
}

TEST_CASE("CheckDestinationRegistration: engine parameters inside their "
          "regions, named once, disjoint but for an alias") {
  DestinationRegistration r = Engine();
  CHECK(CheckDestinationRegistration(r, "node-a").ok());

  r.engine_params[1].byte_offset = 32;
  CHECK(Message(CheckDestinationRegistration(r)) ==
        "instance vllm-0 tp rank 0: engine parameters a (bytes [0, ...)) and "
        "b (bytes [32, ...)) overlap in their region; a destination byte is "
        "written once: declare tied parameters with alias_of");
  r.engine_params[1].byte_offset = 0;
  r.engine_params[1].alias_of = "a";  // tied: exactly a's bytes
  CHECK(CheckDestinationRegistration(r).ok());

  r = Engine();
  r.engine_params[1].byte_offset = 96;
  CHECK(Message(CheckDestinationRegistration(r)).find(
            "ends at byte 160, past the end of region 1 (128 bytes)") !=
        std::string::npos);
  r = Engine();
  r.engine_params[1].buffer = 5;
  CHECK(Message(CheckDestinationRegistration(r)).find(
            "is in region 5, which the rank did not register") !=
        std::string::npos);
  r = Engine();
  r.engine_params[1].name = "a";
  CHECK(Message(CheckDestinationRegistration(r)) ==
        "instance vllm-0 tp rank 0: engine parameter a appears twice");

  r = Engine();
  r.device_staging = true;  // on a host rank
  CHECK(Message(CheckDestinationRegistration(r))
            .rfind("instance vllm-0 tp rank 0: staging DEVICE needs the "
                   "rank's device to be CUDA",
                   0) == 0);
  r.cuda_device = true;
  CHECK(CheckDestinationRegistration(r).ok());

  r = Engine();
  r.layout = DestinationRegistration::Layout::kNone;
  CHECK(Message(CheckDestinationRegistration(r)) ==
        "instance vllm-0 tp rank 0: a layout is required (engine_table or "
        "explicit_pieces)");
  r = Engine();
  r.held_version = -1;
  CHECK(Message(CheckDestinationRegistration(r)) ==
        "instance vllm-0 tp rank 0: pid and held_version must not be "
        "negative");
}

TEST_CASE("CheckDestinationRegistration: an FP8 weight's declaration "
          "(issue 40) is checked at registration, naming the parameter") {
  // a: a 2x8 FP8 weight, b: its scales (one 1x1 block of 128x128).
  DestinationRegistration r = Engine();
  r.engine_params[0].dtype = DType::kF8E4M3;
  r.engine_params[0].fp8.scale = "b";
  r.engine_params[1].local_shape = {1, 1};
  CHECK(CheckDestinationRegistration(r).ok());
  const std::string at =
      "instance vllm-0 tp rank 0: engine parameter a (FP8, scales in b): ";

  DestinationRegistration bad = r;
  bad.engine_params[1].local_shape = {2, 1};
  CHECK(Message(CheckDestinationRegistration(bad)) ==
        at + "its scale tensor b has shape [2, 1]; 128x128 blocks of [2, 8] "
             "need [1, 1]");
  bad = r;
  bad.engine_params[1].dtype = DType::kBF16;
  CHECK(Message(CheckDestinationRegistration(bad)) ==
        at + "its scale tensor b is bf16; block scales are f32");
  bad = r;
  bad.engine_params[0].dtype = DType::kBF16;
  CHECK(Message(CheckDestinationRegistration(bad)) ==
        at + "its dtype is bf16; a weight quantized in flight is f8_e4m3 or "
             "f8_e5m2");
  bad = r;
  bad.engine_params[0].fp8.scale = "c";
  CHECK(Message(CheckDestinationRegistration(bad)) ==
        "instance vllm-0 tp rank 0: engine parameter a (FP8, scales in c): "
        "its scale tensor c is no engine parameter of the rank");
  bad = r;
  bad.engine_params[0].fp8.block_rows = 0;
  CHECK(Message(CheckDestinationRegistration(bad)) ==
        at + "block 0x128 is not in [1, 1048576] each way");
  bad = r;
  bad.engine_params[0].local_shape = {16};
  bad.engine_params[1].local_shape = {16};
  CHECK(Message(CheckDestinationRegistration(bad)) ==
        at + "local shape [16] has fewer than the two dims FP8 blocks span");
  bad = r;
  bad.engine_params[0].fp8.scale = "a";
  CHECK(Message(CheckDestinationRegistration(bad)) ==
        "instance vllm-0 tp rank 0: engine parameter a (FP8, scales in a): "
        "its scale tensor a is the weight itself");
}

TEST_CASE("CheckDestinationRegistration: explicit pieces in registered "
          "regions, no two elements on one byte") {
  DestinationRegistration r = Engine();
  r.engine_params.clear();
  r.layout = DestinationRegistration::Layout::kExplicitPieces;
  r.piece_params = {"w"};
  Piece p;
  p.param = 0;
  p.box = Box{{0, 0}, {2, 8}};
  p.buffer = 1;
  r.pieces = {p};
  CHECK(CheckDestinationRegistration(r).ok());

  r.pieces[0].strides = {0, 1};
  CHECK(Message(CheckDestinationRegistration(r)) ==
        "instance vllm-0 tp rank 0: destination.explicit_pieces.pieces[0]."
        "strides[0] is 0 along a dimension of extent 2 (piece of 'w'): a "
        "destination piece may not put two elements on one byte");
  r.pieces[0].strides.clear();
  r.pieces[0].buffer = 3;
  CHECK(Message(CheckDestinationRegistration(r)) ==
        "instance vllm-0 tp rank 0: piece of w box [0:2, 0:8] is in region "
        "3, which the rank did not register");
}

}  // namespace
}  // namespace ferry
