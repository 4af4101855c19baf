#include "daemon/registration_parser.h"

#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/validation.h"
#include "proto/convert.h"

namespace ferry {
namespace {

// The daemon keeps per-rank state for a whole stream or instance as soon as
// one rank registers (Registry::Snapshot, the plan cache's list of missing
// ranks), so a rank count is bounded before anything is sized by it: one
// registration claiming world_size 2^29 would otherwise cost 8 GiB.
constexpr int32_t kMaxRanks = 65536;

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

// Fills empty strides (row-major contiguous in the box's own shape) once
// the dtype is known. A box whose strides would not fit in 64 bits gets none:
// it lies outside every shape that validated, as ValidateRankPieces reports.
void DefaultStrides(DType dtype, Piece* piece) {
  if (piece->strides.empty() && ValidateShape(piece->box.extent).ok()) {
    piece->strides = RowMajorStrides(StorageShape(piece->box.extent, dtype));
  }
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

// The wire parameter in core form (proto/convert.h), placed in the rank's
// memory: its bytes inside its region, `buffer` the dense buffer index.
absl::StatusOr<EngineParam> PlacedEngineParam(const v1::EngineParameter& p,
                                              absl::string_view who,
                                              const MemoryMap& memory) {
  absl::StatusOr<EngineParam> out = EngineParamFromProto(p, who);
  if (!out.ok()) return out.status();
  const std::string at = absl::StrCat(who, ": engine parameter ", p.name());
  int64_t bytes;
  if (!LiveTensorBytes(out->local_shape, out->dtype, &bytes)) {
    return absl::InvalidArgumentError(
        absl::StrCat(at, ": local_shape ", DimsToString(out->local_shape),
                     " overflows 64 bits"));
  }
  absl::Status s = memory.CheckRange(
      p.region_id(), p.byte_offset(), bytes, who,
      absl::StrCat("engine parameter ", p.name(), " (local shape ",
                   DimsToString(out->local_shape), " ",
                   DTypeName(out->dtype), " at byte ", p.byte_offset(), ")"));
  if (!s.ok()) return s;
  out->buffer = static_cast<uint32_t>(memory.IndexOf(p.region_id()));
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<Participant>> ParseSourceRegistration(
    const v1::SourceRegistration& source, absl::string_view daemon_node,
    const MapOptions& mapping) {
  absl::Status s = ValidateName("source.stream", source.stream());
  if (!s.ok()) return s;
  if (source.world_size() < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "source ", source.stream(), " rank ", source.rank(), ": world_size ",
        source.world_size(), " must be >= 1"));
  }
  if (source.world_size() > kMaxRanks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "source ", source.stream(), " rank ", source.rank(), ": world_size ",
        source.world_size(), " is more than ", kMaxRanks, " ranks"));
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
  p->pid = mapping.map_memory ? source.pid() : 0;
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
    absl::StatusOr<ParamSpec> spec = ParamSpecFromProto(ps, who);
    if (!spec.ok()) return spec.status();
    if (!index.emplace(ps.name(), declared.params.size()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": parameter ", ps.name(), " is declared twice"));
    }
    declared.params.push_back(*std::move(spec));
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
    absl::StatusOr<Piece> piece = PieceFieldsFromProto(source.pieces(i), who);
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
      MemoryMap::Map(source.regions(), who, mapping);
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
    const v1::DestinationRegistration& d, absl::string_view daemon_node,
    const MapOptions& mapping) {
  absl::Status s = ValidateName("destination.instance_id", d.instance_id());
  if (!s.ok()) return s;
  s = ValidateName("destination.stream", d.stream());
  if (!s.ok()) return s;
  if (d.tp_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance ", d.instance_id(), " tp rank ", d.tp_rank(),
                     ": tp_size ", d.tp_size(), " must be >= 1"));
  }
  if (d.tp_size() > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance ", d.instance_id(), " tp rank ", d.tp_rank(),
                     ": tp_size ", d.tp_size(), " is more than ", kMaxRanks,
                     " ranks"));
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
  p->pid = mapping.map_memory ? d.pid() : 0;
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
      MemoryMap::Map(d.regions(), who, mapping);
  if (!memory.ok()) return memory.status();
  const MemoryMap& map = **memory;

  if (d.layout_case() == v1::DestinationRegistration::kEngineTable) {
    p->engine_table = true;
    absl::flat_hash_set<std::string> names;
    for (const v1::EngineParameter& ep : d.engine_table().parameters()) {
      absl::StatusOr<EngineParam> param = PlacedEngineParam(ep, who, map);
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
      absl::StatusOr<Piece> piece = PieceFieldsFromProto(wire, who);
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
