// Each input a fuzz target found that crashed, hung or exhausted memory, fed
// through the same public function as the target feeds it, and the status
// that function now returns.
//
// registration_fuzzer and wire_format_fuzzer inputs are read from
// tests/fuzz/regressions/<target>/ as the fuzzer reads them. The layout
// fuzzer's inputs drive a FuzzedDataProvider (a clang header gcc does not
// have), so its cases are written out here as the model and tables its bytes
// decode to; the bytes are kept in regressions/layout_resolution_fuzzer/ for
// tools/fuzz.sh to replay.
#include <catch2/catch.hpp>

#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/layout_resolution.h"
#include "core/planner.h"
#include "core/validation.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/registration_parser.h"
#include "daemon/registry/registry.h"
#include "proto/ferry/v1/registration.pb.h"
#include "tests/fuzz/registration_input.h"

namespace ferry {
namespace {

// The bytes of tests/fuzz/regressions/<target>/<name> (a data dependency).
std::string Input(const std::string& target, const std::string& name) {
  const std::string path = "tests/fuzz/regressions/" + target + "/" + name;
  std::ifstream in(path, std::ios::binary);
  INFO("reading " << path);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// --- registration_fuzzer ---------------------------------------------------

// A registration_fuzzer input: a selector byte (even: source, odd:
// destination), then the request's protobuf bytes.
struct Registration {
  bool destination = false;
  v1::RegisterSourceRequest source;
  v1::RegisterDestinationRequest dest;
};

Registration ParseInput(const std::string& bytes) {
  REQUIRE(!bytes.empty());
  Registration r;
  r.destination = (bytes[0] & 1) != 0;
  const bool parsed =
      r.destination
          ? r.dest.ParseFromArray(bytes.data() + 1, bytes.size() - 1)
          : r.source.ParseFromArray(bytes.data() + 1, bytes.size() - 1);
  REQUIRE(parsed);
  return r;
}

// What registration_fuzzer runs on a registration: the coordinator's parse
// (nothing mapped), then Registry::Add next to the fixed trainer, Snapshot
// and BuildStreamPlan.
absl::Status Register(const Registration& r) {
  const MapOptions no_mapping{/*map_memory=*/false};
  absl::StatusOr<std::unique_ptr<Participant>> p =
      r.destination ? ParseDestinationRegistration(r.dest.destination(),
                                                   "node-a", no_mapping)
                    : ParseSourceRegistration(r.source.source(), "node-a",
                                              no_mapping);
  if (!p.ok()) return p.status();
  Registry registry(absl::Hours(1), absl::Hours(1));
  auto trainer =
      ParseSourceRegistration(fuzz::Trainer(), "node-a", no_mapping);
  REQUIRE(trainer.ok());
  REQUIRE(registry.Add(*std::move(trainer), false).ok());
  const std::string stream = (*p)->stream;
  auto added = registry.Add(*std::move(p), r.destination
                                               ? r.dest.replace_existing()
                                               : r.source.replace_existing());
  if (!added.ok()) return added.status();
  auto snapshot = registry.Snapshot(stream);
  REQUIRE(snapshot.ok());
  REQUIRE(BuildStreamPlan(*snapshot) != nullptr);
  return absl::OkStatus();
}

// oom-world-size-536870911: a source of stream "fsdp" claiming world_size
// 2^29 - 1. It parsed and registered; Registry::Snapshot then sized its
// sources by world_size (8 GiB of shared_ptrs), as every ferryctl streams,
// ExplainPlan and publish of that stream would. A destination's tp_size
// (InstanceMembers::ranks) was the same bug.
TEST_CASE("registration: a world_size or tp_size past 65536 is refused "
          "before anything is sized by it") {
  Registration r = ParseInput(
      Input("registration_fuzzer", "oom-world-size-536870911"));
  REQUIRE_FALSE(r.destination);
  absl::Status s = Register(r);
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("world_size 536870911 is above the limit 65536"));

  // The largest allowed world registers and plans (a missing-rank error).
  v1::SourceRegistration* src = r.source.mutable_source();
  src->clear_pieces();
  src->clear_parameters();
  src->set_world_size(65536);
  CHECK(Register(r).ok());

  Registration d;
  d.destination = true;
  v1::DestinationRegistration* dst = d.dest.mutable_destination();
  dst->set_instance_id("vllm-0");
  dst->set_stream("policy");
  dst->set_tp_size(std::numeric_limits<int32_t>::max());
  dst->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  dst->mutable_explicit_pieces();
  s = Register(d);
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("tp_size 2147483647 is above the limit 4096"));
  dst->set_tp_size(4096);
  CHECK(Register(d).ok());
}

// crash-source-box-stride-overflow: a source piece whose box has extent
// [0, 2^62, 4] and no strides. The parser filled in row-major strides
// (2^64 for dim 0: a signed overflow) before ValidateRankPieces looked at
// the box. Written by hand after the layout fuzzer's zero-volume finding;
// registration_fuzzer replays it.
TEST_CASE("registration: a source box whose strides overflow is outside its "
          "parameter") {
  Registration r = ParseInput(
      Input("registration_fuzzer", "crash-source-box-stride-overflow"));
  absl::Status s = Register(r);
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  // Refused at the RPC boundary now (docs/api.md, "Limits": an extent is
  // at most 2^40 - 1), before any stride is computed.
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("box.extent[1] is 4611686018427387904"));
  // The same box for a parameter of rank 3.
  v1::ParameterSpec* w = r.source.mutable_source()->mutable_parameters(0);
  w->add_shape(4);
  s = Register(r);
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("box.extent[1] is 4611686018427387904"));
}

// crash-explicit-box-stride-overflow: the same box as an explicit piece of
// a destination with tp_size 1 of the fixed trainer's stream. The
// registration parses (explicit pieces are checked against the stream's
// shapes only when planned); the plan cache's ExplicitLayout filled in the
// overflowing strides before ValidateDestination. The registration is
// accepted and the instance gets an error instead of a plan.
TEST_CASE("plan cache: an explicit destination box whose strides overflow "
          "is refused") {
  Registration r = ParseInput(
      Input("registration_fuzzer", "crash-explicit-box-stride-overflow"));
  REQUIRE(r.destination);
  const MapOptions no_mapping{/*map_memory=*/false};
  Registry registry(absl::Hours(1), absl::Hours(1));
  auto trainer = ParseSourceRegistration(fuzz::Trainer(), "node-a", no_mapping);
  REQUIRE(trainer.ok());
  REQUIRE(registry.Add(*std::move(trainer), false).ok());
  auto p = ParseDestinationRegistration(r.dest.destination(), "node-a",
                                        no_mapping);
  // Refused at the RPC boundary now (an extent is at most 2^40 - 1), so
  // the plan cache never sees the box; its own check stays behind it.
  REQUIRE_FALSE(p.ok());
  CHECK(p.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(p.status().message()),
             Catch::Contains("4611686018427387904"));
}

// --- layout_resolution_fuzzer ----------------------------------------------

// oom-one-table-tp-size-2147483644: one engine table that claims tp_size
// 2^31 - 4. OrderTables sized a vector of table pointers by tp_size before
// checking that the ranks exist: a 16 GiB allocation for one table.
TEST_CASE("layout resolution: a huge tp_size with one table is an error, "
          "not a 16 GiB allocation") {
  ModelSpec model;
  model.params.push_back({"model.layers.0.self_attn.q_proj.weight",
                          static_cast<DType>(84), {}});
  model.BuildIndex();
  EngineTable t;
  t.tp_rank = std::numeric_limits<int32_t>::min();  // as the input decodes
  t.tp_size = 2147483644;
  t.node = "node-a";
  EngineParam p;
  p.name = "model.layers.0.self_attn.q_proj.weight";
  p.loader = LoaderKind::kReplicated;
  p.tp_size = std::numeric_limits<int32_t>::min();
  p.shard_dim = std::numeric_limits<int32_t>::min();
  p.consumes = {p.name};
  t.params = {p};

  auto exact = ResolveDestinationLayout(model, {t});
  REQUIRE_FALSE(exact.ok());
  CHECK(exact.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(exact.status().message()),
             Catch::Contains("is outside [0, 2147483644)"));

  // The same with a rank in range: the missing ranks are named, and still
  // nothing is sized by tp_size.
  t.tp_rank = 0;
  auto missing = ResolveDestinationLayout(model, {t});
  REQUIRE_FALSE(missing.ok());
  CHECK(missing.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(missing.status().message()),
             Catch::Contains("missing table for rank 1 (tp_size 2147483644, "
                             "1 tables)"));
  t.tp_rank = 2147483643;
  auto last = ResolveDestinationLayout(model, {t});
  REQUIRE_FALSE(last.ok());
  CHECK_THAT(std::string(last.status().message()),
             Catch::Contains("missing table for rank 0"));
}

// crash-scalar-parameter-sweep: a scalar (shape []) checkpoint parameter,
// replicated into a scalar live tensor, planned from a trainer rank that
// holds it. ValidateSources' tiling sweep indexed dimension 0 of a
// zero-dimensional box (an out-of-bounds InlinedVector read: an assertion
// failure where NDEBUG is off, a read of garbage where it is on).
TEST_CASE("ValidateSources: a scalar parameter held by a rank tiles") {
  ModelSpec model;
  model.params.push_back(
      {"model.layers.0.mlp.experts.0.w1.weight", DType::kBF16, {}});
  model.BuildIndex();
  EngineTable t;
  t.node = "node-a";
  EngineParam p;
  p.name = "model.layers.0.mlp.experts.0.w1.weight";
  p.dtype = DType::kBF16;
  p.loader = LoaderKind::kVocabParallel;  // loader 3 in the input
  t.params = {p};
  auto resolved = ResolveDestinationLayout(model, {t});
  REQUIRE(resolved.ok());

  RankLayout trainer;
  trainer.rank = 0;
  trainer.node = "node-a";
  trainer.buffer_bytes = {2};
  trainer.pieces = {Piece::Contiguous(0, FullBox({}), 0, 0, DType::kBF16)};
  auto index = ValidateSources(model, {trainer});
  REQUIRE(index.ok());
  CHECK(index->shards_by_param[0].size() == 1);

  auto layout = std::make_shared<std::vector<RankLayout>>();
  for (const ResolvedRank& r : resolved->ranks) layout->push_back(r.layout);
  auto plan = PlanTransfers(model, {trainer}, {Instance{"fuzz-0", layout, {}}});
  CHECK(plan.ok());

  // Nobody holding it is still an error.
  trainer.pieces.clear();
  auto gap = ValidateSources(model, {trainer});
  REQUIRE_FALSE(gap.ok());
  CHECK_THAT(std::string(gap.status().message()),
             Catch::Contains("no source rank holds it"));
}

// crash-dtype-number-past-q6-k: a model whose second parameter's dtype is
// the number 24 (past kQ6_K, the last one). The table resolves (it names
// only the first parameter); ValidateModelSpec then looked the dtype up in
// core's table of 21 dtypes and read past its end.
TEST_CASE("ValidateModelSpec: a dtype number past the last dtype is an "
          "error") {
  ModelSpec model;
  model.params.push_back(
      {"model.layers.0.self_attn.q_proj.weight", DType::kBF16, {}});
  model.params.push_back({"model.layers.0.mlp.experts.0.w1.weight",
                          static_cast<DType>(24), {}});
  model.BuildIndex();
  absl::Status s = ValidateModelSpec(model);
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(s.message()),
             Catch::Contains("'model.layers.0.mlp.experts.0.w1.weight' has "
                             "unknown dtype number 24"));
  model.params[1].dtype = static_cast<DType>(255);
  CHECK_FALSE(ValidateModelSpec(model).ok());
  model.params[1].dtype = DType::kQ6_K;  // the last one is known
  model.params[1].shape = {256};
  CHECK(ValidateModelSpec(model).ok());
}

// crash-zero-volume-shape-stride-overflow: a checkpoint parameter of shape
// [0, 2^63 - 65533, 3]. It has no elements, so ValidateShape let it
// through, but its row-major strides do not fit in 64 bits: the staging
// piece of its fallback tensor (Piece::Contiguous -> RowMajorStrides)
// overflowed a signed multiplication.
TEST_CASE("ValidateShape: a shape without elements whose strides overflow "
          "is too large") {
  const Dims huge = {0, 9223372036854710275, 3};
  CHECK_FALSE(ValidateShape(huge).ok());
  CHECK_FALSE(ValidateShape({0, int64_t{1} << 62}, 4).ok());
  CHECK(ValidateShape({0, int64_t{1} << 60}, 4).ok());
  CHECK(ValidateShape({4096, 0}, 2).ok());

  ModelSpec model;
  model.params.push_back({"model.layers.0.mlp.gate_proj.weight", DType::kBF16,
                          huge});
  model.BuildIndex();
  absl::Status s = ValidateModelSpec(model);
  REQUIRE_FALSE(s.ok());
  CHECK_THAT(std::string(s.message()), Catch::Contains("too large"));

  EngineTable t;
  t.node = "node-a";
  EngineParam p;
  p.name = "model.layers.0.mlp.gate_proj.weight";
  p.dtype = DType::kBF16;
  p.loader = LoaderKind::kVocabParallel;  // falls back: a staging piece
  t.params = {p};
  auto resolved = ResolveDestinationLayout(model, {t});
  REQUIRE_FALSE(resolved.ok());
  CHECK(resolved.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(resolved.status().message()),
             Catch::Contains("checkpoint parameter "
                             "'model.layers.0.mlp.gate_proj.weight'"));

  // crash-zero-volume-local-shape-stride-overflow: the same kind of shape as
  // a live tensor, [0, 2^63 - 1, 2^63 - 1] at TP 4, which resolved direct
  // and overflowed in AppendPieces' strides. The first table entry of each
  // of the four ranks is that parameter.
  const int64_t max = std::numeric_limits<int64_t>::max();
  model.params[0].shape = {0, max, max};
  std::vector<EngineTable> tables(4);
  for (int r = 0; r < 4; ++r) {
    tables[r].tp_rank = r;
    tables[r].tp_size = 4;
    tables[r].buffer_bytes = {2};
    EngineParam live = p;
    live.local_shape = {0, max, max};
    live.tp_size = 4;
    tables[r].params = {live};
  }
  auto live = ResolveDestinationLayout(model, tables);
  REQUIRE_FALSE(live.ok());
  CHECK_THAT(std::string(live.status().message()),
             Catch::Contains("engine parameter "
                             "'model.layers.0.mlp.gate_proj.weight' on rank 0"));
  CHECK_THAT(std::string(live.status().message()),
             Catch::Contains("too large"));
}

}  // namespace
}  // namespace ferry
