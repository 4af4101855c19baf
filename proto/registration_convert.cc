#include "proto/registration_convert.h"

#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/geometry.h"
#include "core/validation.h"
#include "proto/convert.h"

namespace ferry {
namespace {

// The engine table's parameters, or the explicit pieces with their
// parameter names, into `r`.
absl::Status ConvertLayout(const v1::DestinationRegistration& d,
                           const std::string& who,
                           DestinationRegistration* r) {
  if (d.layout_case() == v1::DestinationRegistration::kEngineTable) {
    r->layout = DestinationRegistration::Layout::kEngineTable;
    r->engine_params.reserve(d.engine_table().parameters_size());
    for (const v1::EngineParameter& wire : d.engine_table().parameters()) {
      absl::StatusOr<EngineParam> param = EngineParamFromProto(wire, who);
      if (!param.ok()) return param.status();
      r->engine_params.push_back(*std::move(param));
    }
    return absl::OkStatus();
  }
  if (d.layout_case() != v1::DestinationRegistration::kExplicitPieces) {
    return absl::OkStatus();  // kNone: the rules say a layout is required
  }
  r->layout = DestinationRegistration::Layout::kExplicitPieces;
  absl::flat_hash_map<std::string, int32_t> index;
  for (const v1::Piece& wire : d.explicit_pieces().pieces()) {
    absl::StatusOr<Piece> piece = PieceFieldsFromProto(wire, who);
    if (!piece.ok()) return piece.status();
    auto [it, inserted] =
        index.emplace(wire.parameter(), r->piece_params.size());
    if (inserted) r->piece_params.push_back(wire.parameter());
    piece->param = it->second;
    r->pieces.push_back(*std::move(piece));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<RegionDecl> RegionDeclsFromProto(
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions) {
  std::vector<RegionDecl> out;
  out.reserve(regions.size());
  for (const v1::MemoryRegion& r : regions) {
    out.push_back(RegionDeclFromProto(r));
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const ModelSpec>> DeclarationFromProto(
    const DeclaredParameters& params, absl::string_view who) {
  absl::StatusOr<ModelSpec> declared = ModelSpecFromProto(params, who);
  if (!declared.ok()) return declared.status();
  absl::Status s = ValidateModelSpec(*declared);
  if (!s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(who, ": ", s.message()));
  }
  return std::make_shared<const ModelSpec>(*std::move(declared));
}

absl::StatusOr<SourceRegistration> SourceRegistrationFromProto(
    const v1::SourceRegistration& source,
    const DeclarationConverter& declarations) {
  SourceRegistration r;
  r.stream = source.stream();
  r.node = source.node();
  r.rank = source.rank();
  r.world_size = source.world_size();
  r.pid = source.pid();
  const std::string who = r.Who();
  absl::Status s = ValidateDevice(source.device(), who);
  if (!s.ok()) return s;
  absl::StatusOr<std::shared_ptr<const ModelSpec>> model =
      declarations != nullptr ? declarations(source.parameters(), who)
                              : DeclarationFromProto(source.parameters(), who);
  if (!model.ok()) return model.status();
  r.model = *std::move(model);
  r.regions = RegionDeclsFromProto(source.regions());
  r.pieces.reserve(source.pieces_size());
  for (const v1::Piece& wire : source.pieces()) {
    absl::StatusOr<Piece> piece = PieceFieldsFromProto(wire, who);
    if (!piece.ok()) return piece.status();
    piece->param = r.model->Find(wire.parameter());
    if (piece->param < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": piece of ", wire.parameter(), " box ",
          BoxToString(piece->box),
          ": the rank does not declare that parameter (list it in "
          "parameters)"));
    }
    r.pieces.push_back(*std::move(piece));
  }
  return r;
}

absl::StatusOr<DestinationRegistration> DestinationRegistrationFromProto(
    const v1::DestinationRegistration& d) {
  DestinationRegistration r;
  r.instance_id = d.instance_id();
  r.stream = d.stream();
  r.node = d.node();
  r.tp_rank = d.tp_rank();
  r.tp_size = d.tp_size();
  r.pid = d.pid();
  r.held_version = d.held_version();
  const std::string who = r.Who();
  absl::Status s = ValidateDevice(d.device(), who);
  if (!s.ok()) return s;
  if (!v1::StagingPlacement_IsValid(d.staging())) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": staging ", d.staging(), " is not a placement"));
  }
  r.cuda_device = d.device().kind() == v1::DEVICE_KIND_CUDA;
  r.device_staging = d.staging() == v1::STAGING_PLACEMENT_DEVICE;
  r.regions = RegionDeclsFromProto(d.regions());
  s = ConvertLayout(d, who, &r);
  if (!s.ok()) return s;
  return r;
}

}  // namespace ferry
