#include "proto/convert.h"

#include <string>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "core/limits.h"

namespace ferry {
namespace {

// core indexes buffers by id (EngineTable::buffer_bytes); keep that vector
// small. Clients choose small ids in practice (SharedTensorArena uses the
// rank's own numbering from 0).
constexpr uint32_t kMaxCoreBufferId = 65536;

// "<who>: <message>", or the message alone without a who.
std::string At(absl::string_view who, absl::string_view message) {
  return who.empty() ? std::string(message) : absl::StrCat(who, ": ", message);
}

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

absl::Status ValidateName(absl::string_view field, absl::string_view value) {
  if (value.empty() || value.size() > Limits::kMaxNameBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " ", Quote(value), " must be 1 to ", Limits::kMaxNameBytes,
        " characters of [A-Za-z0-9._-]"));
  }
  for (char c : value) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' &&
        c != '_' && c != '-') {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " ", Quote(value), " has character ",
          Quote(absl::string_view(&c, 1)), "; allowed: [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateDevice(const v1::Device& device, absl::string_view who) {
  switch (device.kind()) {
    case v1::DEVICE_KIND_HOST:
      return absl::OkStatus();
    case v1::DEVICE_KIND_CUDA:
      if (device.cuda_uuid().empty()) {
        return absl::InvalidArgumentError(
            At(who, "a CUDA device needs cuda_uuid"));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          At(who, "device.kind is required (HOST or CUDA)"));
  }
}

v1::DType DTypeToProto(DType dtype) {
  return static_cast<v1::DType>(static_cast<int>(dtype));
}

absl::StatusOr<DType> DTypeFromProto(int wire_dtype, absl::string_view who) {
  if (!IsValidDTypeNumber(wire_dtype)) {
    return absl::InvalidArgumentError(At(
        who, wire_dtype == 0
                 ? std::string("dtype is required (got DTYPE_UNSPECIFIED)")
                 : absl::StrCat("unknown dtype ", wire_dtype,
                                " (a number this build does not know)")));
  }
  return static_cast<DType>(wire_dtype);
}

absl::StatusOr<Dims> DimsFromProto(
    const google::protobuf::RepeatedField<int64_t>& values,
    absl::string_view what) {
  for (int64_t v : values) {
    if (v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has a negative entry ", v));
    }
  }
  return ToDims(values);
}

v1::Box BoxToProto(const Box& box) {
  v1::Box out;
  AppendDims(box.offset, out.mutable_offset());
  AppendDims(box.extent, out.mutable_extent());
  return out;
}

absl::StatusOr<Box> BoxFromProto(const v1::Box& box, absl::string_view what) {
  if (box.offset_size() != box.extent_size()) {
    return absl::InvalidArgumentError(
        At(what, absl::StrCat("box has ", box.offset_size(), " offsets but ",
                              box.extent_size(), " extents")));
  }
  absl::StatusOr<Dims> offset = DimsFromProto(box.offset(), At(what, "box offset"));
  if (!offset.ok()) return offset.status();
  absl::StatusOr<Dims> extent = DimsFromProto(box.extent(), At(what, "box extent"));
  if (!extent.ok()) return extent.status();
  Box out;
  out.offset = *std::move(offset);
  out.extent = *std::move(extent);
  return out;
}

v1::ParameterSpec ParamSpecToProto(const ParamSpec& param) {
  v1::ParameterSpec out;
  out.set_name(param.name);
  out.set_dtype(DTypeToProto(param.dtype));
  AppendDims(param.shape, out.mutable_shape());
  return out;
}

absl::StatusOr<ParamSpec> ParamSpecFromProto(const v1::ParameterSpec& param,
                                             absl::string_view who) {
  if (param.name().empty()) {
    return absl::InvalidArgumentError(
        At(who, "a declared parameter has no name"));
  }
  const std::string at = At(who, absl::StrCat("parameter ", param.name()));
  absl::StatusOr<DType> dtype = DTypeFromProto(param.dtype(), at);
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<Dims> shape =
      DimsFromProto(param.shape(), absl::StrCat(at, ": shape"));
  if (!shape.ok()) return shape.status();
  return ParamSpec{param.name(), *dtype, *std::move(shape)};
}

std::vector<v1::ParameterSpec> ModelSpecToProto(const ModelSpec& model) {
  std::vector<v1::ParameterSpec> out;
  out.reserve(model.params.size());
  for (const ParamSpec& p : model.params) out.push_back(ParamSpecToProto(p));
  return out;
}

absl::StatusOr<ModelSpec> ModelSpecFromProto(
    const google::protobuf::RepeatedPtrField<v1::ParameterSpec>& params,
    absl::string_view who) {
  ModelSpec model;
  for (const v1::ParameterSpec& p : params) {
    absl::StatusOr<ParamSpec> spec = ParamSpecFromProto(p, who);
    if (!spec.ok()) return spec.status();
    model.params.push_back(*std::move(spec));
  }
  model.BuildIndex();
  for (size_t i = 0; i < model.params.size(); ++i) {
    if (model.Find(model.params[i].name) != static_cast<int32_t>(i)) {
      return absl::InvalidArgumentError(At(
          who, absl::StrCat("parameter ", model.params[i].name,
                            " is declared twice")));
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

absl::StatusOr<Piece> PieceFieldsFromProto(const v1::Piece& p,
                                           absl::string_view who) {
  if (p.parameter().empty()) {
    return absl::InvalidArgumentError(
        At(who, "a piece has no parameter (it is required)"));
  }
  const std::string at = At(who, absl::StrCat("piece of ", p.parameter()));
  if (!p.has_box()) {
    return absl::InvalidArgumentError(absl::StrCat(at, ": box is required"));
  }
  absl::StatusOr<Box> box = BoxFromProto(p.box(), at);
  if (!box.ok()) return box.status();
  if (p.byte_offset() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, " box ", BoxToString(*box),
                     " has negative byte_offset ", p.byte_offset()));
  }
  if (p.strides_size() != 0 &&
      static_cast<size_t>(p.strides_size()) != box->rank()) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, " box ", BoxToString(*box), " has ",
                     p.strides_size(), " strides for ", box->rank(),
                     " dimensions"));
  }
  Piece piece;
  for (int64_t s : p.strides()) {
    if (s < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, " box ", BoxToString(*box),
                       " has a negative stride ", s));
    }
    piece.strides.push_back(s);
  }
  piece.box = *std::move(box);
  piece.buffer = p.region_id();
  piece.byte_offset = p.byte_offset();
  return piece;
}

absl::StatusOr<Piece> PieceFromProto(const v1::Piece& piece,
                                     const ModelSpec& model,
                                     absl::string_view who) {
  absl::StatusOr<Piece> out = PieceFieldsFromProto(piece, who);
  if (!out.ok()) return out.status();
  const int32_t param = model.Find(piece.parameter());
  if (param < 0) {
    return absl::InvalidArgumentError(At(
        who, absl::StrCat("piece of parameter '", piece.parameter(), "' box ",
                          BoxToString(out->box),
                          ": the model does not declare that parameter")));
  }
  out->param = param;
  if (out->strides.empty()) {
    out->strides = RowMajorStrides(
        StorageShape(out->box.extent, model.params[param].dtype));
  }
  return out;
}

RegionDecl RegionDeclFromProto(const v1::MemoryRegion& r) {
  return RegionDecl{r.region_id(), r.size_bytes(),
                    r.memory_case() != v1::MemoryRegion::MEMORY_NOT_SET};
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

uint32_t LoaderFlagsFromProto(
    const google::protobuf::RepeatedField<int>& flags) {
  uint32_t out = kFlagNone;
  for (int wire : flags) {
    if (wire == v1::LOADER_FLAG_UNSPECIFIED) continue;
    bool known = false;
    for (const FlagMapping& f : kFlags) {
      if (wire == f.wire) {
        out |= f.core;
        known = true;
      }
    }
    // A flag from a newer client: ferry cannot know what it means, so the
    // parameter must go through the engine's own loader.
    if (!known) out |= kUnknownLoaderFlagBit;
  }
  return out;
}

v1::EngineParameter EngineParamToProto(const EngineParam& p) {
  v1::EngineParameter e;
  e.set_name(p.name);
  e.set_dtype(DTypeToProto(p.dtype));
  AppendDims(p.local_shape, e.mutable_local_shape());
  e.set_region_id(p.buffer);
  e.set_byte_offset(p.byte_offset);
  e.set_loader(LoaderKindToProto(p.loader));
  e.set_loader_tp_size(p.tp_size);
  e.set_shard_dim(p.shard_dim);
  for (const FlagMapping& f : kFlags) {
    if (p.flags & f.core) e.add_flags(f.wire);
  }
  for (const FusedPart& part : p.parts) {
    v1::FusedPart* w = e.add_fused_parts();
    w->set_checkpoint_name(part.checkpoint_name);
    AppendDims(part.lead_index, w->mutable_lead_index());
    w->set_local_extent(part.local_extent);
  }
  for (const std::string& c : p.consumes) e.add_consumes(c);
  e.set_alias_of(p.alias_of);
  if (p.fp8.declared()) {
    v1::Fp8Quantization* f = e.mutable_fp8();
    f->set_scale_parameter(p.fp8.scale);
    f->set_block_rows(p.fp8.block_rows);
    f->set_block_cols(p.fp8.block_cols);
  }
  return e;
}

absl::StatusOr<EngineParam> EngineParamFromProto(
    const v1::EngineParameter& param, absl::string_view who) {
  if (param.name().empty()) {
    return absl::InvalidArgumentError(
        At(who, "an engine parameter has no name"));
  }
  const std::string at =
      At(who, absl::StrCat("engine parameter ", param.name()));
  absl::StatusOr<DType> dtype = DTypeFromProto(param.dtype(), at);
  if (!dtype.ok()) return dtype.status();
  absl::StatusOr<Dims> shape =
      DimsFromProto(param.local_shape(), absl::StrCat(at, ": local_shape"));
  if (!shape.ok()) return shape.status();
  EngineParam out;
  out.name = param.name();
  out.dtype = *dtype;
  out.local_shape = *std::move(shape);
  out.buffer = param.region_id();
  out.byte_offset = param.byte_offset();
  out.loader = LoaderKindFromProto(param.loader());
  out.tp_size = param.loader_tp_size();
  out.shard_dim = param.shard_dim();
  out.flags = LoaderFlagsFromProto(param.flags());
  std::vector<FusedPart> parts;
  parts.reserve(param.fused_parts_size());
  for (const v1::FusedPart& w : param.fused_parts()) {
    if (w.checkpoint_name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": a fused part has no checkpoint_name"));
    }
    const std::string part_at =
        absl::StrCat(at, ": fused part ", w.checkpoint_name());
    absl::StatusOr<Dims> lead =
        DimsFromProto(w.lead_index(), absl::StrCat(part_at, " lead_index"));
    if (!lead.ok()) return lead.status();
    if (w.local_extent() < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          part_at, " has negative local_extent ", w.local_extent()));
    }
    FusedPart part;
    part.checkpoint_name = w.checkpoint_name();
    part.lead_index = *std::move(lead);
    part.local_extent = w.local_extent();
    parts.push_back(std::move(part));
  }
  out.parts = FusedParts(std::move(parts));
  for (const std::string& c : param.consumes()) {
    if (c.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": consumes an empty name"));
    }
    out.consumes.push_back(c);
  }
  out.alias_of = param.alias_of();
  if (param.has_fp8()) {
    const v1::Fp8Quantization& f = param.fp8();
    if (f.scale_parameter().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          at, ": fp8 names no scale_parameter (the engine parameter holding "
              "its block scales)"));
    }
    out.fp8.scale = f.scale_parameter();
    out.fp8.block_rows = f.block_rows() == 0 ? 128 : f.block_rows();
    out.fp8.block_cols = f.block_cols() == 0 ? 128 : f.block_cols();
  }
  return out;
}

v1::EngineParameterTable EngineTableToProto(const EngineTable& table) {
  v1::EngineParameterTable out;
  for (const EngineParam& p : table.params) {
    *out.add_parameters() = EngineParamToProto(p);
  }
  return out;
}

absl::StatusOr<EngineTable> EngineTableFromProto(
    const v1::DestinationRegistration& registration) {
  const std::string who =
      absl::StrCat("instance ", registration.instance_id(), " tp rank ",
                   registration.tp_rank());
  if (!registration.has_engine_table()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": registration has no engine_table"));
  }
  EngineTable table;
  table.tp_rank = registration.tp_rank();
  table.tp_size = registration.tp_size();
  table.node = registration.node();
  for (const v1::MemoryRegion& r : registration.regions()) {
    if (r.region_id() >= kMaxCoreBufferId) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": region id ", r.region_id(),
                       " is too large (max ", kMaxCoreBufferId - 1, ")"));
    }
    if (table.buffer_bytes.size() <= r.region_id()) {
      table.buffer_bytes.resize(r.region_id() + 1, 0);
    }
    table.buffer_bytes[r.region_id()] = r.size_bytes();
  }
  for (const v1::EngineParameter& p :
       registration.engine_table().parameters()) {
    absl::StatusOr<EngineParam> param = EngineParamFromProto(p, who);
    if (!param.ok()) return param.status();
    table.params.push_back(*std::move(param));
  }
  return table;
}

const char* UpdateEventKindName(v1::UpdateEventKind kind) {
  switch (kind) {
    case v1::UPDATE_EVENT_KIND_PREPARE:
      return "PREPARE";
    case v1::UPDATE_EVENT_KIND_PAUSE:
      return "PAUSE";
    case v1::UPDATE_EVENT_KIND_APPLY:
      return "APPLY";
    case v1::UPDATE_EVENT_KIND_COMMIT:
      return "COMMIT";
    case v1::UPDATE_EVENT_KIND_ABORT:
      return "ABORT";
    default:
      return "UNKNOWN";
  }
}

}  // namespace ferry
