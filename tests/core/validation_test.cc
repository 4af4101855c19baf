// Bad input: every malformed layout gets INVALID_ARGUMENT with a message
// that names the parameter, the rank and the box; nothing crashes.
#include <catch2/catch.hpp>

#include <limits>
#include <random>
#include <set>

#include "core/parallel_for.h"
#include "core/planner.h"
#include "core/region_copy.h"
#include "core/validation.h"

namespace ferry {
namespace {

ModelSpec Model() {
  ModelSpec m;
  m.params.push_back({"layers.0.mlp.up_proj.weight", DType::kBF16, {8, 4}});
  m.params.push_back({"layers.0.q.weight", DType::kQ4_0, {2, 64}});
  m.BuildIndex();
  return m;
}

RankLayout Rank(int rank, std::vector<Piece> pieces) {
  RankLayout r;
  r.rank = rank;
  r.node = "n0";
  r.pieces = std::move(pieces);
  r.buffer_bytes = {1 << 20};
  return r;
}

Piece P(int param, Box box, int64_t offset = 0, DType dtype = DType::kBF16) {
  return Piece::Contiguous(param, std::move(box), 0, offset, dtype);
}

// Two ranks, each half of "up_proj" on dim 0, both halves of q on rank 0.
std::vector<RankLayout> Good() {
  return {Rank(0, {P(0, {{0, 0}, {4, 4}}), P(1, {{0, 0}, {2, 64}}, 4096, DType::kQ4_0)}),
          Rank(1, {P(0, {{4, 0}, {4, 4}})})};
}

void ExpectError(const absl::Status& s, std::initializer_list<const char*> words) {
  INFO(s.ToString());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  for (const char* w : words) CHECK(std::string(s.message()).find(w) != std::string::npos);
}

TEST_CASE("A good layout validates") {
  const ModelSpec m = Model();
  REQUIRE(ValidateModelSpec(m).ok());
  REQUIRE(ValidateSources(m, Good()).ok());
}

TEST_CASE("A gap names the parameter and the missing box") {
  auto ranks = Good();
  ranks[1].pieces[0].box = {{4, 0}, {3, 4}};
  ExpectError(ValidateSources(Model(), ranks).status(),
              {"up_proj", "[7:8, 0:4]", "held by no trainer rank"});
}

TEST_CASE("A parameter nobody holds is a gap") {
  auto ranks = Good();
  ranks[0].pieces.pop_back();
  ExpectError(ValidateSources(Model(), ranks).status(), {"layers.0.q.weight", "no source"});
}

TEST_CASE("Overlap between non-replicas names both ranks and boxes") {
  auto ranks = Good();
  ranks[1].pieces[0].box = {{3, 0}, {5, 4}};
  ExpectError(ValidateSources(Model(), ranks).status(),
              {"up_proj", "rank 0", "[0:4, 0:4]", "rank 1", "[3:8, 0:4]"});
}

TEST_CASE("Identical boxes on different ranks are replicas, not overlaps") {
  auto ranks = Good();
  ranks.push_back(Rank(2, {P(0, {{0, 0}, {4, 4}})}));
  auto index = ValidateSources(Model(), ranks);
  REQUIRE(index.ok());
  CHECK(index->shards_by_param[0][0].holders.size() == 2);
}

TEST_CASE("Duplicate ranks and a box registered twice are rejected") {
  auto ranks = Good();
  ranks[1].rank = 0;
  ExpectError(ValidateSources(Model(), ranks).status(), {"rank 0", "twice"});
  ranks = Good();
  ranks[1].pieces.push_back(P(0, {{4, 0}, {4, 4}}, 64));
  ExpectError(ValidateSources(Model(), ranks).status(), {"up_proj", "rank 1", "twice"});
}

TEST_CASE("Shape and rank mismatches name the parameter") {
  auto ranks = Good();
  ranks[1].pieces[0].box = {{4, 0}, {4, 5}};
  ExpectError(ValidateSources(Model(), ranks).status(), {"up_proj", "rank 1", "outside"});
  ranks = Good();
  ranks[1].pieces[0].box = {{4}, {4}};
  ExpectError(ValidateSources(Model(), ranks).status(), {"up_proj", "rank 1", "rank"});
}

TEST_CASE("A split inside a quantization block is rejected") {
  auto ranks = Good();
  ranks[0].pieces[1] = P(1, {{0, 0}, {2, 48}}, 4096, DType::kQ4_0);
  ExpectError(ValidateSources(Model(), ranks).status(), {"layers.0.q.weight", "block"});
  ModelSpec bad;
  bad.params.push_back({"q", DType::kQ4_K, {4, 100}});
  ExpectError(ValidateModelSpec(bad), {"'q'", "whole blocks"});
}

TEST_CASE("Negative and overflowing dims are rejected, not computed with") {
  ModelSpec m;
  m.params.push_back({"neg", DType::kF32, {-1, 4}});
  ExpectError(ValidateModelSpec(m), {"neg", "negative"});
  m.params[0] = {"huge", DType::kF32, {int64_t{1} << 40, int64_t{1} << 30}};
  ExpectError(ValidateModelSpec(m), {"huge", "overflow"});
  auto ranks = Good();
  ranks[1].pieces[0].box = {{4, 0}, {std::numeric_limits<int64_t>::max(), 4}};
  ExpectError(ValidateSources(Model(), ranks).status(), {"up_proj", "rank 1"});
  ranks = Good();
  ranks[1].pieces[0].strides = {std::numeric_limits<int64_t>::max() / 2, 1};
  ExpectError(ValidateSources(Model(), ranks).status(), {"up_proj", "rank 1", "overflow"});
}

TEST_CASE("A piece outside its registered buffer names the byte range") {
  auto ranks = Good();
  ranks[1].buffer_bytes = {20};
  ExpectError(ValidateSources(Model(), ranks).status(),
              {"up_proj", "rank 1", "ends at byte 32",
               "past the end of buffer 0 (20 bytes)"});
  ranks = Good();
  ranks[1].pieces[0].buffer = 3;
  ExpectError(ValidateSources(Model(), ranks).status(), {"rank 1", "buffer 3"});
}

TEST_CASE("Unknown parameters and staging on a source are rejected") {
  auto ranks = Good();
  ranks[1].pieces[0].param = 7;
  ExpectError(ValidateSources(Model(), ranks).status(), {"rank 1", "unknown parameter"});
  ranks = Good();
  ranks[1].pieces[0].buffer = kStagingBufferBit;
  ExpectError(ValidateSources(Model(), ranks).status(), {"rank 1", "staging"});
}

TEST_CASE("Destination errors name the instance and rank") {
  const ModelSpec m = Model();
  std::vector<RankLayout> dst = {Rank(0, {P(0, {{0, 0}, {4, 4}}), P(0, {{2, 0}, {4, 4}}, 64)})};
  ExpectError(ValidateDestination(m, dst, "r7"), {"instance r7 rank 0", "up_proj", "overlaps"});
  Instance inst;
  inst.id = "r7";
  inst.layout = std::make_shared<std::vector<RankLayout>>(dst);
  ExpectError(PlanTransfers(m, Good(), {inst}).status(), {"instance r7", "overlaps"});
  dst = {Rank(1, {P(0, {{0, 0}, {4, 4}})}), Rank(1, {})};
  ExpectError(ValidateDestination(m, dst, "r7"), {"rank 1", "twice"});
}

TEST_CASE("Destination errors on several ranks: the lowest rank's, on any "
          "number of threads") {
  const ModelSpec m = Model();
  std::vector<RankLayout> dst;
  for (int r = 0; r < 8; ++r) dst.push_back(Rank(r, {P(0, {{0, 0}, {4, 4}})}));
  // Rank 2 writes two overlapping boxes; rank 6 a zero stride.
  dst[2].pieces.push_back(P(0, {{2, 0}, {4, 4}}, 64));
  dst[6].pieces[0].strides = {0, 1};
  for (int threads : {1, 2, 3, 8}) {
    INFO("planning threads " << threads);
    SetPlanningThreads(threads);
    const absl::Status s = ValidateDestination(m, dst, "r7");
    SetPlanningThreads(0);
    ExpectError(s, {"instance r7 rank 2", "overlaps"});
    CHECK(std::string(s.message()).find("rank 6") == std::string::npos);
  }
}

TEST_CASE("Destination pieces: zero strides and shared bytes are refused") {
  const ModelSpec m = Model();
  // A zero stride along dim 0 (extent 4) writes 4 elements onto 4 bytes.
  Piece zero = P(0, {{0, 0}, {4, 4}});
  zero.strides = {0, 1};
  ExpectError(ValidateDestination(m, {Rank(0, {zero})}, "r7"),
              {"instance r7 rank 0", "up_proj", "[0:4, 0:4]", "strides [0, 1]",
               "stride 0 along dim 0"});
  // Two parameters whose pieces write the same bytes of one buffer: named
  // both, with the byte.
  std::vector<RankLayout> dst = {
      Rank(0, {P(0, {{0, 0}, {8, 4}}), P(1, {{0, 0}, {2, 64}}, 32, DType::kQ4_0)})};
  ExpectError(ValidateDestination(m, dst, "r7"),
              {"up_proj", "layers.0.q.weight", "[0:2, 0:64]",
               "both write byte 32 of buffer 0", "alias_of"});
  // In other buffers, the same offsets are fine.
  dst[0].pieces[1].buffer = 1;
  dst[0].buffer_bytes = {1 << 20, 1 << 20};
  CHECK(ValidateDestination(m, dst, "r7").ok());
}

// A [2, n] F32 tensor as n one-column pieces, each stored in place (row
// stride n): the pieces' spans all overlap, their bytes interleave.
constexpr int64_t kColumns = 30000;
ModelSpec WideModel() {
  ModelSpec m;
  m.params.push_back({"wide.weight", DType::kF32, {2, kColumns}});
  m.BuildIndex();
  return m;
}
RankLayout OneColumnPieces() {
  RankLayout r = Rank(0, {});
  for (int64_t c = 0; c < kColumns; ++c) {
    Piece p;
    p.param = 0;
    p.box = {{0, c}, {2, 1}};
    p.byte_offset = c * 4;
    p.strides = {kColumns, 1};
    r.pieces.push_back(p);
  }
  return r;
}

TEST_CASE("One-column destination pieces interleave without sharing bytes") {
  const ModelSpec m = WideModel();
  const int64_t n = kColumns;
  RankLayout r = OneColumnPieces();
  CHECK(ValidateDestination(m, {r}, "wide").ok());
  // Column 7 twice: the element check names the box.
  Piece again = r.pieces[7];
  again.byte_offset = 2 * n * 4;  // other bytes, same elements
  r.pieces.push_back(again);
  r.buffer_bytes = {1 << 20};
  ExpectError(ValidateDestination(m, {r}, "wide"),
              {"wide.weight", "[0:2, 7:8]", "overlaps box [0:2, 7:8]"});
}

// The proof's budget is the rank's: its parameters and its buffers draw
// on one count of runs, so one rank's check is bounded as a whole.
TEST_CASE("One budget of runs bounds a rank's whole overlap proof") {
  const ModelSpec m = WideModel();
  const int64_t n = kColumns;
  RankLayout r = OneColumnPieces();
  // Two runs per piece in the parameter, two in the buffer: 4n in all.
  CHECK(ValidateDestinationRank(m, r, "wide", 4 * n).ok());
  const absl::Status s = ValidateDestinationRank(m, r, "wide", 3 * n);
  CHECK(s.code() == absl::StatusCode::kResourceExhausted);
  const std::string message(s.message());
  CHECK(message.find("in buffer 0 interleave too finely") != std::string::npos);
}

// The destination check against an independent oracle: every storage unit
// of every piece enumerated, its bytes marked in its buffer and its index
// marked in its parameter. Random boxes, offsets, buffers and strides
// (nested row-major with padding, or anything), 1-D to 3-D and a
// block-quantized dtype. A shared byte or element must be refused; what
// passes must share none; nested pieces that share none must pass (other
// strides may be refused fail-closed).
TEST_CASE("The destination check agrees with marking every byte") {
  ModelSpec m;
  m.params.push_back({"a.weight", DType::kBF16, {6, 8}});
  m.params.push_back({"b.bias", DType::kF32, {12}});
  m.params.push_back({"c.experts", DType::kBF16, {2, 3, 4}});
  m.params.push_back({"q.weight", DType::kQ4_0, {4, 128}});
  m.BuildIndex();
  std::mt19937 rng(20261205);
  auto uniform = [&rng](int64_t lo, int64_t hi) {  // [lo, hi]
    return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
  };
  int refused = 0, passed = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    RankLayout r = Rank(0, {});
    r.buffer_bytes = {1 << 12, 1 << 12};
    bool all_nested = true;
    const int n = static_cast<int>(uniform(1, 4));
    for (int k = 0; k < n; ++k) {
      Piece p;
      p.param = static_cast<int32_t>(uniform(0, 3));
      const ParamSpec& spec = m.params[p.param];
      const int64_t block = BlockElems(spec.dtype);
      const size_t rank = spec.shape.size();
      p.box.offset.resize(rank);
      p.box.extent.resize(rank);
      for (size_t d = 0; d < rank; ++d) {
        const int64_t unit = d + 1 == rank ? block : 1;
        const int64_t units = spec.shape[d] / unit;
        const int64_t at = uniform(0, units - 1);
        p.box.offset[d] = at * unit;
        p.box.extent[d] = uniform(1, units - at) * unit;
      }
      p.buffer = static_cast<uint32_t>(uniform(0, 1));
      p.byte_offset = uniform(0, 200);
      p.strides.resize(rank);
      if (uniform(0, 2) > 0) {  // nested: row-major with padded rows
        int64_t stride = 1;
        for (size_t d = rank; d-- > 0;) {
          p.strides[d] = stride;
          const int64_t unit = d + 1 == rank ? block : 1;
          stride *= p.box.extent[d] / unit + uniform(0, 2);
        }
      } else {
        all_nested = false;
        for (size_t d = 0; d < rank; ++d) p.strides[d] = uniform(0, 12);
      }
      r.pieces.push_back(std::move(p));
    }
    if (!ValidateRankPieces(m, r, "t", false).ok()) continue;
    // The oracle.
    bool shared = false;
    std::set<std::pair<uint32_t, int64_t>> bytes;
    std::set<std::pair<int32_t, int64_t>> elems;
    for (const Piece& p : r.pieces) {
      const ParamSpec& spec = m.params[p.param];
      const Box units = StorageBox(p.box, spec.dtype);
      const Dims shape = StorageShape(spec.shape, spec.dtype);
      const int64_t unit_bytes = UnitBytes(spec.dtype);
      Dims at(units.rank(), 0);
      for (int64_t i = 0; i < Volume(units.extent); ++i) {
        int64_t rem = i, addr = p.byte_offset, elem = 0, pitch = 1;
        for (size_t d = units.rank(); d-- > 0;) {
          at[d] = rem % units.extent[d];
          rem /= units.extent[d];
          addr += at[d] * p.strides[d] * unit_bytes;
          elem += (units.offset[d] + at[d]) * pitch;
          pitch *= shape[d];
        }
        for (int64_t b = 0; b < unit_bytes; ++b) {
          shared |= !bytes.insert({p.buffer, addr + b}).second;
        }
        shared |= !elems.insert({p.param, elem}).second;
      }
    }
    const absl::Status s = ValidateDestinationRank(m, r, "t", 1 << 20);
    INFO("trial " << trial << ": " << s.ToString());
    if (shared) CHECK_FALSE(s.ok());
    if (s.ok()) CHECK_FALSE(shared);
    if (all_nested && !shared) CHECK(s.ok());
    (s.ok() ? passed : refused) += 1;
  }
  CHECK(passed > 500);
  CHECK(refused > 500);
}

}  // namespace
}  // namespace ferry
