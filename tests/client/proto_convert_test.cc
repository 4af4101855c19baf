// Round trips between core types and ferry.v1 messages (proto/convert.h),
// and the conversions that must fail closed.
#include <catch2/catch.hpp>

#include "proto/convert.h"

namespace ferry {
namespace {

ModelSpec TwoParamModel() {
  ModelSpec m;
  m.params.push_back({"model.layers.0.self_attn.q_proj.weight", DType::kBF16,
                      Dims{4096, 1024}});
  m.params.push_back({"model.norm.weight", DType::kF32, Dims{1024}});
  m.params.push_back({"blocks.q4k", DType::kQ4_K, Dims{8, 512}});
  m.BuildIndex();
  return m;
}

TEST_CASE("every dtype round-trips and matches the wire numbers") {
  for (int i = 1; i <= static_cast<int>(DType::kQ6_K); ++i) {
    const DType d = static_cast<DType>(i);
    const v1::DType wire = DTypeToProto(d);
    CHECK(static_cast<int>(wire) == i);
    auto back = DTypeFromProto(wire);
    REQUIRE(back.ok());
    CHECK(*back == d);
  }
  CHECK(DTypeToProto(DType::kBF16) == v1::DTYPE_BF16);
  CHECK(DTypeToProto(DType::kQ4_K) == v1::DTYPE_Q4_K);
  CHECK(DTypeFromProto(v1::DTYPE_UNSPECIFIED).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(DTypeFromProto(99).status().code() == absl::StatusCode::kInvalidArgument);
}

TEST_CASE("boxes round-trip; mismatched ranks are rejected") {
  Box box{{2048, 0}, {2048, 1024}};
  auto back = BoxFromProto(BoxToProto(box));
  REQUIRE(back.ok());
  CHECK(*back == box);

  Box scalar;  // a scalar parameter's box has no dims
  auto s = BoxFromProto(BoxToProto(scalar));
  REQUIRE(s.ok());
  CHECK(s->rank() == 0);

  v1::Box bad;
  bad.add_offset(0);
  bad.add_offset(0);
  bad.add_extent(4);
  auto e = BoxFromProto(bad);
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().message() == "box has 2 offsets but 1 extents");
}

TEST_CASE("parameter specs and model specs round-trip") {
  const ModelSpec model = TwoParamModel();
  google::protobuf::RepeatedPtrField<v1::ParameterSpec> wire;
  for (const v1::ParameterSpec& p : ModelSpecToProto(model)) *wire.Add() = p;
  auto back = ModelSpecFromProto(wire);
  REQUIRE(back.ok());
  REQUIRE(back->params.size() == model.params.size());
  for (size_t i = 0; i < model.params.size(); ++i) {
    CHECK(back->params[i].name == model.params[i].name);
    CHECK(back->params[i].dtype == model.params[i].dtype);
    CHECK(back->params[i].shape == model.params[i].shape);
  }
  CHECK(back->Find("model.norm.weight") == 1);

  *wire.Add() = wire.Get(0);  // declared twice
  auto dup = ModelSpecFromProto(wire);
  REQUIRE_FALSE(dup.ok());
  CHECK(dup.status().message() ==
        "parameter model.layers.0.self_attn.q_proj.weight is declared twice");
}

TEST_CASE("pieces round-trip by name, with and without strides") {
  const ModelSpec model = TwoParamModel();
  Piece strided;
  strided.param = 0;
  strided.box = Box{{2048, 0}, {2048, 1024}};
  strided.buffer = 7;
  strided.byte_offset = 4096;
  strided.strides = Dims{2048, 1};  // rows of a wider local tensor
  auto wire = PieceToProto(strided, model);
  REQUIRE(wire.ok());
  CHECK(wire->parameter() == "model.layers.0.self_attn.q_proj.weight");
  CHECK(wire->region_id() == 7);
  auto back = PieceFromProto(*wire, model);
  REQUIRE(back.ok());
  CHECK(back->param == 0);
  CHECK(back->box == strided.box);
  CHECK(back->buffer == 7u);
  CHECK(back->byte_offset == 4096);
  CHECK(back->strides == strided.strides);

  // Empty wire strides mean row-major in the box's storage shape: for Q4_K
  // the innermost dim counts blocks of 256 elements.
  Piece q = Piece::Contiguous(2, Box{{0, 0}, {8, 512}}, 1, 0, DType::kQ4_K);
  auto qw = PieceToProto(q, model);
  REQUIRE(qw.ok());
  qw->clear_strides();
  auto qb = PieceFromProto(*qw, model);
  REQUIRE(qb.ok());
  CHECK(qb->strides == Dims{2, 1});
}

TEST_CASE("pieces of unknown parameters are rejected with the name") {
  const ModelSpec model = TwoParamModel();
  Piece p;
  p.param = 5;
  auto w = PieceToProto(p, model);
  REQUIRE_FALSE(w.ok());
  CHECK(w.status().message() ==
        "piece refers to parameter index 5 of a model with 3 parameters");

  v1::Piece wire;
  wire.set_parameter("lm_head.weight");
  *wire.mutable_box() = BoxToProto(Box{{0, 0}, {4, 8}});
  auto b = PieceFromProto(wire, model);
  REQUIRE_FALSE(b.ok());
  CHECK(b.status().message() ==
        "piece of parameter 'lm_head.weight' box [0:4, 0:8]: the model does not declare that parameter");
}

EngineTable SampleTable() {
  EngineTable t;
  t.tp_rank = 1;
  t.tp_size = 2;
  t.node = "infer-0";
  t.buffer_bytes = {1 << 20, 0, 4096};
  EngineParam qkv;
  qkv.name = "model.layers.0.self_attn.qkv_proj.weight";
  qkv.dtype = DType::kBF16;
  qkv.local_shape = {3072, 1024};
  qkv.buffer = 0;
  qkv.byte_offset = 256;
  qkv.loader = LoaderKind::kFused;
  qkv.tp_size = 2;
  qkv.shard_dim = 0;
  std::vector<FusedPart> qkv_parts;
  for (const char* part : {"q_proj", "k_proj", "v_proj"}) {
    FusedPart fp;
    fp.checkpoint_name = std::string("model.layers.0.self_attn.") + part + ".weight";
    // GQA with TP above the kv heads: each rank holds one whole kv head.
    if (part != std::string("q_proj")) fp.local_extent = 128;
    qkv_parts.push_back(fp);
  }
  qkv.parts = FusedParts(std::move(qkv_parts));
  EngineParam w13;
  w13.name = "model.layers.0.mlp.experts.w13_weight";
  w13.dtype = DType::kBF16;
  w13.local_shape = {2, 512, 1024};
  w13.buffer = 2;
  w13.loader = LoaderKind::kFused;
  w13.tp_size = 2;
  FusedPart gate;
  gate.checkpoint_name = "model.layers.0.mlp.experts.3.gate_proj.weight";
  gate.lead_index = {1};
  w13.parts = {gate};
  EngineParam custom;
  custom.name = "model.layers.0.self_attn.kv_b_proj.weight";
  custom.dtype = DType::kF8E4M3;
  custom.local_shape = {64};
  custom.loader = LoaderKind::kCustom;
  custom.flags = kFlagTransformed | kFlagPacked;
  custom.consumes = {"a", "b"};
  t.params = {qkv, w13, custom};
  return t;
}

TEST_CASE("engine tables round-trip through a destination registration") {
  const EngineTable table = SampleTable();
  v1::DestinationRegistration r;
  r.set_instance_id("vllm-0");
  r.set_tp_rank(table.tp_rank);
  r.set_tp_size(table.tp_size);
  r.set_node(table.node);
  for (uint32_t id : {0u, 2u}) {
    v1::MemoryRegion* region = r.add_regions();
    region->set_region_id(id);
    region->set_size_bytes(table.buffer_bytes[id]);
  }
  *r.mutable_engine_table() = EngineTableToProto(table);
  auto back = EngineTableFromProto(r);
  REQUIRE(back.ok());
  CHECK(back->tp_rank == 1);
  CHECK(back->tp_size == 2);
  CHECK(back->node == "infer-0");
  CHECK(back->buffer_bytes == table.buffer_bytes);
  REQUIRE(back->params.size() == table.params.size());
  for (size_t i = 0; i < table.params.size(); ++i) {
    const EngineParam& a = table.params[i];
    const EngineParam& b = back->params[i];
    CHECK(a.name == b.name);
    CHECK(a.dtype == b.dtype);
    CHECK(a.local_shape == b.local_shape);
    CHECK(a.buffer == b.buffer);
    CHECK(a.byte_offset == b.byte_offset);
    CHECK(a.loader == b.loader);
    CHECK(a.tp_size == b.tp_size);
    CHECK(a.shard_dim == b.shard_dim);
    CHECK(a.flags == b.flags);
    CHECK(a.consumes == b.consumes);
    REQUIRE(a.parts.size() == b.parts.size());
    for (size_t j = 0; j < a.parts.size(); ++j) {
      CHECK(a.parts[j].checkpoint_name == b.parts[j].checkpoint_name);
      CHECK(a.parts[j].lead_index == b.parts[j].lead_index);
      CHECK(a.parts[j].local_extent == b.parts[j].local_extent);
    }
  }
  const v1::EngineParameter& wire = r.engine_table().parameters(2);
  REQUIRE(wire.flags_size() == 2);
  CHECK(wire.flags(0) == v1::LOADER_FLAG_PACKED);
  CHECK(wire.flags(1) == v1::LOADER_FLAG_TRANSFORMED);
}

TEST_CASE("unknown loader kinds and flags fail closed to fallback") {
  v1::EngineParameter p;
  p.set_name("x.weight");
  p.set_dtype(v1::DTYPE_BF16);
  p.set_loader(static_cast<v1::LoaderKind>(42));
  p.add_flags(v1::LOADER_FLAG_UNSPECIFIED);
  auto a = EngineParamFromProto(p);
  REQUIRE(a.ok());
  CHECK(a->loader == LoaderKind::kCustom);
  CHECK(a->flags == kFlagNone);  // UNSPECIFIED is ignored

  p.set_loader(v1::LOADER_KIND_COLUMN);
  p.add_flags(static_cast<v1::LoaderFlag>(77));  // from a newer client
  auto b = EngineParamFromProto(p);
  REQUIRE(b.ok());
  CHECK(b->loader == LoaderKind::kColumn);
  CHECK((b->flags & kUnknownLoaderFlagBit) != 0);  // resolution falls back

  p.set_loader(v1::LOADER_KIND_UNSPECIFIED);
  CHECK(EngineParamFromProto(p)->loader == LoaderKind::kCustom);
}

TEST_CASE("engine table conversions reject what core cannot hold") {
  v1::DestinationRegistration r;
  r.set_instance_id("vllm-0");
  auto none = EngineTableFromProto(r);
  REQUIRE_FALSE(none.ok());
  CHECK(none.status().message() ==
        "instance vllm-0 tp rank 0: registration has no engine_table");

  r.mutable_engine_table()->add_parameters()->set_name("w");
  auto nodtype = EngineTableFromProto(r);
  REQUIRE_FALSE(nodtype.ok());
  CHECK(nodtype.status().code() == absl::StatusCode::kInvalidArgument);

  r.mutable_engine_table()->mutable_parameters(0)->set_dtype(v1::DTYPE_BF16);
  r.add_regions()->set_region_id(1u << 20);
  auto big = EngineTableFromProto(r);
  REQUIRE_FALSE(big.ok());
  CHECK(big.status().message() ==
        "instance vllm-0 tp rank 0: region id 1048576 is too large (max 65535)");
}

TEST_CASE("fused parts: local_extent travels both ways, negatives are refused") {
  const EngineTable table = SampleTable();
  const v1::EngineParameterTable wire = EngineTableToProto(table);
  REQUIRE(wire.parameters(0).fused_parts_size() == 3);
  CHECK(wire.parameters(0).fused_parts(0).local_extent() == 0);
  CHECK(wire.parameters(0).fused_parts(1).local_extent() == 128);
  v1::EngineParameter bad = wire.parameters(0);
  bad.mutable_fused_parts(2)->set_local_extent(-1);
  auto e = EngineParamFromProto(bad, "instance vllm-0 tp rank 1");
  REQUIRE_FALSE(e.ok());
  CHECK(e.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(e.status().message()),
             Catch::Contains("v_proj.weight has negative local_extent -1"));
}


TEST_CASE("alias_of travels both ways") {
  EngineTable table = SampleTable();
  EngineParam head = table.params[0];
  head.name = "lm_head.weight";
  head.alias_of = table.params[0].name;
  table.params.push_back(head);
  const v1::EngineParameterTable wire = EngineTableToProto(table);
  const int last = wire.parameters_size() - 1;
  CHECK(wire.parameters(0).alias_of().empty());
  CHECK(wire.parameters(last).alias_of() == table.params[0].name);
  auto back = EngineParamFromProto(wire.parameters(last));
  REQUIRE(back.ok());
  CHECK(back->alias_of == table.params[0].name);
}

TEST_CASE("an FP8 declaration travels both ways; block 0 means 128, no "
          "scale tensor is refused") {
  EngineTable table = SampleTable();
  table.params[0].dtype = DType::kF8E4M3;
  table.params[0].fp8.scale = "scales";
  table.params[0].fp8.block_cols = 64;
  const v1::EngineParameterTable wire = EngineTableToProto(table);
  CHECK_FALSE(wire.parameters(1).has_fp8());
  REQUIRE(wire.parameters(0).has_fp8());
  CHECK(wire.parameters(0).fp8().scale_parameter() == "scales");
  auto back = EngineParamFromProto(wire.parameters(0));
  REQUIRE(back.ok());
  CHECK(back->fp8 == table.params[0].fp8);
  CHECK(*back == table.params[0]);

  v1::EngineParameter defaults = wire.parameters(0);
  defaults.mutable_fp8()->clear_block_rows();
  defaults.mutable_fp8()->clear_block_cols();
  back = EngineParamFromProto(defaults);
  REQUIRE(back.ok());
  CHECK(back->fp8.block_rows == 128);
  CHECK(back->fp8.block_cols == 128);

  v1::EngineParameter nameless = wire.parameters(0);
  nameless.mutable_fp8()->clear_scale_parameter();
  back = EngineParamFromProto(nameless, "instance vllm-0 tp rank 1");
  REQUIRE_FALSE(back.ok());
  CHECK(back.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(back.status().message()),
             Catch::Contains("fp8 names no scale_parameter"));
}

}  // namespace
}  // namespace ferry
