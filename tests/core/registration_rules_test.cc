// core/registration_rules.h: the one definition of what a rank's regions
// and pieces must be, which the client libraries and the daemon both run
// (tests/client/client_validation_test.cc and
// tests/daemon/protocol_errors_test.cc check that each says it).
#include "core/registration_rules.h"

#include <string>
#include <vector>

#include "catch2/catch.hpp"

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

}  // namespace
}  // namespace ferry
