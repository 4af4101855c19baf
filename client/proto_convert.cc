#include "client/proto_convert.h"

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

constexpr int kLastDType = static_cast<int>(DType::kQ6_K);
// core indexes buffers by id (EngineTable::buffer_bytes); keep that vector
// small. Clients choose small ids in practice (SharedTensorArena uses the
// rank's own numbering from 0).
constexpr uint32_t kMaxCoreBufferId = 65536;

Dims ToDims(const google::protobuf::RepeatedField<int64_t>& values) {
  return Dims(values.begin(), values.end());
}

template <typename Container>
void AppendDims(const Container& dims,
                google::protobuf::RepeatedField<int64_t>* out) {
  for (int64_t d : dims) out->Add(d);
}

struct FlagMapping {
  v1::LoaderFlag wire;
  EngineParamFlag core;
};
constexpr FlagMapping kFlags[] = {
    {v1::LOADER_FLAG_PACKED, kFlagPacked},
    {v1::LOADER_FLAG_TRANSPOSED, kFlagTransposed},
    {v1::LOADER_FLAG_PRE_SHARDED, kFlagPreSharded},
    {v1::LOADER_FLAG_WRAPPED_LOADER, kFlagWrappedLoader},
    {v1::LOADER_FLAG_TRANSFORMED, kFlagTransformed},
};

}  // namespace

v1::DType DTypeToProto(DType dtype) {
  return static_cast<v1::DType>(static_cast<int>(dtype));
}

absl::StatusOr<DType> DTypeFromProto(int wire_dtype) {
  if (wire_dtype <= 0 || wire_dtype > kLastDType) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown dtype ", wire_dtype,
                     " (DTYPE_UNSPECIFIED or a number this build does not "
                     "know)"));
  }
  return static_cast<DType>(wire_dtype);
}

v1::Box BoxToProto(const Box& box) {
  v1::Box out;
  AppendDims(box.offset, out.mutable_offset());
  AppendDims(box.extent, out.mutable_extent());
  return out;
}

absl::StatusOr<Box> BoxFromProto(const v1::Box& box) {
  if (box.offset_size() != box.extent_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "box has ", box.offset_size(), " offsets but ", box.extent_size(),
        " extents"));
  }
  Box out;
  out.offset = ToDims(box.offset());
  out.extent = ToDims(box.extent());
  return out;
}

v1::ParameterSpec ParamSpecToProto(const ParamSpec& param) {
  v1::ParameterSpec out;
  out.set_name(param.name);
  out.set_dtype(DTypeToProto(param.dtype));
  AppendDims(param.shape, out.mutable_shape());
  return out;
}

absl::StatusOr<ParamSpec> ParamSpecFromProto(const v1::ParameterSpec& param) {
  if (param.name().empty()) {
    return absl::InvalidArgumentError("parameter without a name");
  }
  absl::StatusOr<DType> dtype = DTypeFromProto(param.dtype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter ", param.name(), ": ", dtype.status().message()));
  }
  return ParamSpec{param.name(), *dtype, ToDims(param.shape())};
}

std::vector<v1::ParameterSpec> ModelSpecToProto(const ModelSpec& model) {
  std::vector<v1::ParameterSpec> out;
  out.reserve(model.params.size());
  for (const ParamSpec& p : model.params) out.push_back(ParamSpecToProto(p));
  return out;
}

absl::StatusOr<ModelSpec> ModelSpecFromProto(
    const google::protobuf::RepeatedPtrField<v1::ParameterSpec>& params) {
  ModelSpec model;
  for (const v1::ParameterSpec& p : params) {
    absl::StatusOr<ParamSpec> spec = ParamSpecFromProto(p);
    if (!spec.ok()) return spec.status();
    model.params.push_back(*std::move(spec));
  }
  model.BuildIndex();
  for (size_t i = 0; i < model.params.size(); ++i) {
    if (model.Find(model.params[i].name) != static_cast<int32_t>(i)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", model.params[i].name, " is declared twice"));
    }
  }
  return model;
}

absl::StatusOr<v1::Piece> PieceToProto(const Piece& piece,
                                       const ModelSpec& model) {
  if (piece.param < 0 ||
      static_cast<size_t>(piece.param) >= model.params.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("piece refers to parameter index ", piece.param,
                     " of a model with ", model.params.size(), " parameters"));
  }
  v1::Piece out;
  out.set_parameter(model.params[piece.param].name);
  *out.mutable_box() = BoxToProto(piece.box);
  out.set_region_id(piece.buffer);
  out.set_byte_offset(piece.byte_offset);
  AppendDims(piece.strides, out.mutable_strides());
  return out;
}

absl::StatusOr<Piece> PieceFromProto(const v1::Piece& piece,
                                     const ModelSpec& model) {
  const int32_t param = model.Find(piece.parameter());
  if (param < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "piece of parameter '", piece.parameter(),
        "', which the model does not declare"));
  }
  absl::StatusOr<Box> box = BoxFromProto(piece.box());
  if (!box.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "piece of ", piece.parameter(), ": ", box.status().message()));
  }
  Piece out;
  out.param = param;
  out.buffer = piece.region_id();
  out.byte_offset = piece.byte_offset();
  if (piece.strides_size() == 0) {
    out.strides = RowMajorStrides(
        StorageShape(box->extent, model.params[param].dtype));
  } else {
    out.strides = ToDims(piece.strides());
  }
  out.box = *std::move(box);
  return out;
}

v1::LoaderKind LoaderKindToProto(LoaderKind kind) {
  switch (kind) {
    case LoaderKind::kReplicated:
      return v1::LOADER_KIND_REPLICATED;
    case LoaderKind::kColumn:
      return v1::LOADER_KIND_COLUMN;
    case LoaderKind::kRow:
      return v1::LOADER_KIND_ROW;
    case LoaderKind::kVocabParallel:
      return v1::LOADER_KIND_VOCAB_PARALLEL;
    case LoaderKind::kFused:
      return v1::LOADER_KIND_FUSED;
    case LoaderKind::kCustom:
      return v1::LOADER_KIND_CUSTOM;
  }
  return v1::LOADER_KIND_CUSTOM;
}

LoaderKind LoaderKindFromProto(int wire_kind) {
  switch (wire_kind) {
    case v1::LOADER_KIND_REPLICATED:
      return LoaderKind::kReplicated;
    case v1::LOADER_KIND_COLUMN:
      return LoaderKind::kColumn;
    case v1::LOADER_KIND_ROW:
      return LoaderKind::kRow;
    case v1::LOADER_KIND_VOCAB_PARALLEL:
      return LoaderKind::kVocabParallel;
    case v1::LOADER_KIND_FUSED:
      return LoaderKind::kFused;
    default:  // CUSTOM, UNSPECIFIED, or a kind from a newer client
      return LoaderKind::kCustom;
  }
}

v1::EngineParameterTable EngineTableToProto(const EngineTable& table) {
  v1::EngineParameterTable out;
  for (const EngineParam& p : table.params) {
    v1::EngineParameter* e = out.add_parameters();
    e->set_name(p.name);
    e->set_dtype(DTypeToProto(p.dtype));
    AppendDims(p.local_shape, e->mutable_local_shape());
    e->set_region_id(p.buffer);
    e->set_byte_offset(p.byte_offset);
    e->set_loader(LoaderKindToProto(p.loader));
    e->set_loader_tp_size(p.tp_size);
    e->set_shard_dim(p.shard_dim);
    for (const FlagMapping& f : kFlags) {
      if (p.flags & f.core) e->add_flags(f.wire);
    }
    for (const FusedPart& part : p.parts) {
      v1::FusedPart* w = e->add_fused_parts();
      w->set_checkpoint_name(part.checkpoint_name);
      AppendDims(part.lead_index, w->mutable_lead_index());
    }
    for (const std::string& c : p.consumes) e->add_consumes(c);
  }
  return out;
}

absl::StatusOr<EngineParam> EngineParamFromProto(
    const v1::EngineParameter& param) {
  if (param.name().empty()) {
    return absl::InvalidArgumentError("engine parameter without a name");
  }
  absl::StatusOr<DType> dtype = DTypeFromProto(param.dtype());
  if (!dtype.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "engine parameter ", param.name(), ": ", dtype.status().message()));
  }
  EngineParam out;
  out.name = param.name();
  out.dtype = *dtype;
  out.local_shape = ToDims(param.local_shape());
  out.buffer = param.region_id();
  out.byte_offset = param.byte_offset();
  out.loader = LoaderKindFromProto(param.loader());
  out.tp_size = param.loader_tp_size();
  out.shard_dim = param.shard_dim();
  for (int wire : param.flags()) {
    if (wire == v1::LOADER_FLAG_UNSPECIFIED) continue;
    bool known = false;
    for (const FlagMapping& f : kFlags) {
      if (wire == f.wire) {
        out.flags |= f.core;
        known = true;
      }
    }
    // A flag from a newer client: ferry cannot know what it means, so the
    // parameter must go through the engine's own loader.
    if (!known) out.flags |= kFlagTransformed;
  }
  for (const v1::FusedPart& w : param.fused_parts()) {
    if (w.checkpoint_name().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "engine parameter ", param.name(), ": fused part without a name"));
    }
    FusedPart part;
    part.checkpoint_name = w.checkpoint_name();
    part.lead_index = ToDims(w.lead_index());
    out.parts.push_back(std::move(part));
  }
  out.consumes.assign(param.consumes().begin(), param.consumes().end());
  return out;
}

absl::StatusOr<EngineTable> EngineTableFromProto(
    const v1::DestinationRegistration& registration) {
  if (!registration.has_engine_table()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "instance ", registration.instance_id(), " tp rank ",
        registration.tp_rank(), ": registration has no engine_table"));
  }
  EngineTable table;
  table.tp_rank = registration.tp_rank();
  table.tp_size = registration.tp_size();
  table.node = registration.node();
  for (const v1::MemoryRegion& r : registration.regions()) {
    if (r.region_id() >= kMaxCoreBufferId) {
      return absl::InvalidArgumentError(
          absl::StrCat("region id ", r.region_id(), " is too large (max ",
                       kMaxCoreBufferId - 1, ")"));
    }
    if (table.buffer_bytes.size() <= r.region_id()) {
      table.buffer_bytes.resize(r.region_id() + 1, 0);
    }
    table.buffer_bytes[r.region_id()] = r.size_bytes();
  }
  for (const v1::EngineParameter& p : registration.engine_table().parameters()) {
    absl::StatusOr<EngineParam> param = EngineParamFromProto(p);
    if (!param.ok()) return param.status();
    table.params.push_back(*std::move(param));
  }
  return table;
}

}  // namespace ferry
