#include "daemon/registration_parser.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/validation.h"
#include "daemon/wire_types.h"

namespace ferry {
namespace {

absl::Status CheckNode(absl::string_view who, const std::string& node,
                       absl::string_view daemon_node) {
  if (!node.empty() && node != daemon_node) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": registered with the daemon of node ", daemon_node,
        " but says it runs on node ", node,
        "; register with the ferryd on your own node"));
  }
  return absl::OkStatus();
}

// A wire piece in core form; `buffer` is still the client's region id and
// `param` is -1 (the caller resolves the name).
absl::StatusOr<Piece> PieceFromProto(const v1::Piece& p, absl::string_view who,
                                     size_t index) {
  const std::string what =
      p.parameter().empty()
          ? absl::StrCat("piece ", index)
          : absl::StrCat("piece ", index, " (", p.parameter(), ")");
  if (p.parameter().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", what, ": parameter is required"));
  }
  if (!p.has_box()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", what, ": box is required"));
  }
  absl::StatusOr<Box> box = BoxFromProto(p.box(), absl::StrCat(who, ": ", what));
  if (!box.ok()) return box.status();
  if (p.byte_offset() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", what, " box ", BoxToString(*box), " has negative "
        "byte_offset ", p.byte_offset()));
  }
  if (p.strides_size() != 0 &&
      static_cast<size_t>(p.strides_size()) != box->rank()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", what, " box ", BoxToString(*box), " has ",
        p.strides_size(), " strides for ", box->rank(), " dimensions"));
  }
  Piece piece;
  piece.box = *std::move(box);
  piece.buffer = p.region_id();
  piece.byte_offset = p.byte_offset();
  for (int64_t s : p.strides()) {
    if (s < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": ", what, " box ", BoxToString(piece.box),
          " has a negative stride ", s));
    }
    piece.strides.push_back(s);
  }
  return piece;
}

// Fills empty strides (row-major contiguous in the box's own shape) once
// the dtype is known.
void DefaultStrides(DType dtype, Piece* piece) {
  if (piece->strides.empty()) {
    piece->strides = RowMajorStrides(StorageShape(piece->box.extent, dtype));
  }
}

LoaderKind LoaderFromProto(int kind) {
  switch (kind) {
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
    default:  // CUSTOM, UNSPECIFIED and kinds from a newer client
      return LoaderKind::kCustom;
  }
}

// Unknown flags fail closed: a bit core does not know makes the parameter
// fall back ("unknown flags").
constexpr uint32_t kUnknownFlagBit = 1u << 31;

uint32_t FlagsFromProto(const google::protobuf::RepeatedField<int>& flags) {
  uint32_t out = kFlagNone;
  for (int f : flags) {
    switch (f) {
      case v1::LOADER_FLAG_UNSPECIFIED:
        break;
      case v1::LOADER_FLAG_PACKED:
        out |= kFlagPacked;
        break;
      case v1::LOADER_FLAG_TRANSPOSED:
        out |= kFlagTransposed;
        break;
      case v1::LOADER_FLAG_PRE_SHARDED:
        out |= kFlagPreSharded;
        break;
      case v1::LOADER_FLAG_WRAPPED_LOADER:
        out |= kFlagWrappedLoader;
        break;
      case v1::LOADER_FLAG_TRANSFORMED:
        out |= kFlagTransformed;
        break;
      default:
        out |= kUnknownFlagBit;
    }
  }
  return out;
}

// Bytes of a contiguous live tensor (a block-quantized last dim rounded up
// to whole blocks; such a tensor falls back anyway).
bool LiveTensorBytes(const Dims& shape, DType dtype, int64_t* bytes) {
  const int64_t block = BlockElems(dtype);
  int64_t units = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d =
        i + 1 == shape.size() ? (shape[i] + block - 1) / block : shape[i];
    if (!CheckedMul(units, d, &units)) return false;
  }
  return CheckedMul(units, UnitBytes(dtype), bytes);
}

absl::StatusOr<EngineParam> EngineParamFromProto(const v1::EngineParameter& p,
                                                 int32_t tp_rank,
                                                 absl::string_view who,
                                                 const MemoryMap& memory) {
  if (p.name().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": an engine parameter has no name"));
  }
  const std::string what = absl::StrCat("engine parameter ", p.name());
  const std::string at = absl::StrCat(who, ": ", what);
  EngineParam out;
  out.name = p.name();
  absl::StatusOr<DType> dtype = DTypeFromProto(p.dtype(), at);
  if (!dtype.ok()) return dtype.status();
  out.dtype = *dtype;
  absl::StatusOr<Dims> shape =
      DimsFromProto(p.local_shape(), absl::StrCat(at, ": local_shape"));
  if (!shape.ok()) return shape.status();
  out.local_shape = *std::move(shape);
  int64_t bytes;
  if (!LiveTensorBytes(out.local_shape, out.dtype, &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": local_shape ", DimsToString(out.local_shape),
                     " overflows 64 bits"));
  }
  absl::Status s = memory.CheckRange(
      p.region_id(), p.byte_offset(), bytes, who,
      absl::StrCat(what, " (local shape ", DimsToString(out.local_shape), " ",
                   DTypeName(out.dtype), " at byte ", p.byte_offset(), ")"));
  if (!s.ok()) return s;
  out.buffer = static_cast<uint32_t>(memory.IndexOf(p.region_id()));
  out.byte_offset = p.byte_offset();
  out.loader = LoaderFromProto(p.loader());
  out.tp_size = p.loader_tp_size();
  out.shard_dim = p.shard_dim();
  out.flags = FlagsFromProto(p.flags());
  for (const v1::FusedPart& part : p.fused_parts()) {
    if (part.checkpoint_name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": a fused part has no checkpoint_name"));
    }
    FusedPart fp;
    fp.checkpoint_name = part.checkpoint_name();
    absl::StatusOr<Dims> lead = DimsFromProto(
        part.lead_index(),
        absl::StrCat(at, ": fused part ", part.checkpoint_name(),
                     " lead_index"));
    if (!lead.ok()) return lead.status();
    fp.lead_index = *std::move(lead);
    if (part.local_extent() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": fused part ", part.checkpoint_name(),
                       " has negative local_extent ", part.local_extent()));
    }
    fp.local_extent = part.local_extent();
    out.parts.push_back(std::move(fp));
  }
  for (const std::string& c : p.consumes()) {
    if (c.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, ": consumes an empty name"));
    }
    out.consumes.push_back(c);
  }
  (void)tp_rank;
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Participant>> ParseSourceRegistration(
    const v1::SourceRegistration& source, absl::string_view daemon_node) {
  absl::Status s = ValidateName("source.stream", source.stream());
  if (!s.ok()) return s;
  if (source.world_size() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "source ", source.stream(), " rank ", source.rank(), ": world_size ",
        source.world_size(), " must be >= 1"));
  }
  if (source.rank() < 0 || source.rank() >= source.world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("source ", source.stream(), ": rank ", source.rank(),
                     " is outside [0, ", source.world_size(), ")"));
  }
  auto p = std::make_unique<Participant>();
  p->role = Role::kSource;
  p->stream = source.stream();
  p->rank = source.rank();
  p->world_size = source.world_size();
  p->node = std::string(daemon_node);
  p->device = source.device();
  p->pid = source.pid();
  const std::string who = p->Describe();
  s = CheckNode(who, source.node(), daemon_node);
  if (!s.ok()) return s;
  s = ValidateDevice(source.device(), who);
  if (!s.ok()) return s;
  if (source.pid() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": pid ", source.pid(), " is negative"));
  }

  ModelSpec declared;
  absl::flat_hash_map<std::string, int32_t> index;
  for (const v1::ParameterSpec& ps : source.parameters()) {
    if (ps.name().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": a declared parameter has no name"));
    }
    const std::string at = absl::StrCat(who, ": parameter ", ps.name());
    if (!index.emplace(ps.name(), declared.params.size()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(at, " is declared twice"));
    }
    ParamSpec spec;
    spec.name = ps.name();
    absl::StatusOr<DType> dtype = DTypeFromProto(ps.dtype(), at);
    if (!dtype.ok()) return dtype.status();
    spec.dtype = *dtype;
    absl::StatusOr<Dims> shape =
        DimsFromProto(ps.shape(), absl::StrCat(at, ": shape"));
    if (!shape.ok()) return shape.status();
    spec.shape = *std::move(shape);
    declared.params.push_back(std::move(spec));
  }
  declared.BuildIndex();
  s = ValidateModelSpec(declared);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", s.message()));
  }

  RankLayout layout;
  layout.rank = source.rank();
  layout.node = p->node;
  for (int i = 0; i < source.pieces_size(); ++i) {
    absl::StatusOr<Piece> piece = PieceFromProto(source.pieces(i), who, i);
    if (!piece.ok()) return piece.status();
    auto it = index.find(source.pieces(i).parameter());
    if (it == index.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": piece of ", source.pieces(i).parameter(), " box ",
          BoxToString(piece->box),
          ": the rank does not declare that parameter (list it in "
          "parameters)"));
    }
    piece->param = it->second;
    DefaultStrides(declared.params[it->second].dtype, &*piece);
    layout.pieces.push_back(*std::move(piece));
  }
  // Boxes, block alignment and strides against the declared shapes.
  s = ValidateRankPieces(declared, layout, who, /*allow_staging=*/false);
  if (!s.ok()) return s;

  absl::StatusOr<std::unique_ptr<MemoryMap>> memory =
      MemoryMap::Map(source.regions(), who);
  if (!memory.ok()) return memory.status();
  s = ValidatePiecesInRegions(**memory, declared.params, layout.pieces, who);
  if (!s.ok()) return s;
  for (Piece& piece : layout.pieces) {
    piece.buffer = static_cast<uint32_t>((*memory)->IndexOf(piece.buffer));
  }
  p->params = std::move(declared.params);
  p->pieces = std::move(layout.pieces);
  p->memory = *std::move(memory);
  return p;
}

absl::StatusOr<std::unique_ptr<Participant>> ParseDestinationRegistration(
    const v1::DestinationRegistration& d, absl::string_view daemon_node) {
  absl::Status s = ValidateName("destination.instance_id", d.instance_id());
  if (!s.ok()) return s;
  s = ValidateName("destination.stream", d.stream());
  if (!s.ok()) return s;
  if (d.tp_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance ", d.instance_id(), " tp rank ", d.tp_rank(),
                     ": tp_size ", d.tp_size(), " must be >= 1"));
  }
  if (d.tp_rank() < 0 || d.tp_rank() >= d.tp_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance ", d.instance_id(), ": tp_rank ", d.tp_rank(),
                     " is outside [0, ", d.tp_size(), ")"));
  }
  auto p = std::make_unique<Participant>();
  p->role = Role::kDestination;
  p->stream = d.stream();
  p->instance_id = d.instance_id();
  p->tp_rank = d.tp_rank();
  p->tp_size = d.tp_size();
  p->held_version = d.held_version();
  p->node = std::string(daemon_node);
  p->device = d.device();
  p->pid = d.pid();
  const std::string who = p->Describe();
  s = CheckNode(who, d.node(), daemon_node);
  if (!s.ok()) return s;
  s = ValidateDevice(d.device(), who);
  if (!s.ok()) return s;
  if (d.pid() < 0 || d.held_version() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": pid and held_version must not be negative"));
  }
  if (d.layout_case() == v1::DestinationRegistration::LAYOUT_NOT_SET) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": a layout is required (engine_table or explicit_pieces)"));
  }

  absl::StatusOr<std::unique_ptr<MemoryMap>> memory =
      MemoryMap::Map(d.regions(), who);
  if (!memory.ok()) return memory.status();
  const MemoryMap& map = **memory;

  if (d.layout_case() == v1::DestinationRegistration::kEngineTable) {
    p->engine_table = true;
    absl::flat_hash_set<std::string> names;
    for (const v1::EngineParameter& ep : d.engine_table().parameters()) {
      absl::StatusOr<EngineParam> param =
          EngineParamFromProto(ep, d.tp_rank(), who, map);
      if (!param.ok()) return param.status();
      if (!names.insert(param->name).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": engine parameter ", param->name, " appears twice"));
      }
      p->engine_params.push_back(*std::move(param));
    }
  } else {
    absl::flat_hash_map<std::string, int32_t> index;
    for (int i = 0; i < d.explicit_pieces().pieces_size(); ++i) {
      const v1::Piece& wire = d.explicit_pieces().pieces(i);
      absl::StatusOr<Piece> piece = PieceFromProto(wire, who, i);
      if (!piece.ok()) return piece.status();
      const int32_t buffer = map.IndexOf(wire.region_id());
      if (buffer < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": piece of ", wire.parameter(), " box ",
            BoxToString(piece->box), " is in region ", wire.region_id(),
            ", which the rank did not register"));
      }
      // Bounds need the parameter's dtype, which the stream declares: they
      // are checked when the plan is built (ExplainPlan shows failures).
      piece->buffer = static_cast<uint32_t>(buffer);
      auto [it, inserted] =
          index.emplace(wire.parameter(), p->piece_params.size());
      if (inserted) p->piece_params.push_back(wire.parameter());
      piece->param = it->second;
      p->pieces.push_back(*std::move(piece));
    }
  }
  p->memory = *std::move(memory);
  return p;
}

}  // namespace ferry
