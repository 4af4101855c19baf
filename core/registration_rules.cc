#include "core/registration_rules.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/geometry.h"
#include "core/validation.h"

namespace ferry {

absl::Status CheckRankInGroup(absl::string_view who,
                              absl::string_view rank_name, int64_t rank,
                              absl::string_view size_name, int64_t size) {
  if (size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", size_name, " ", size, " must be >= 1"));
  }
  if (rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", rank_name, " ", rank, " is outside [0, ", size, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<RegionDecl>> CheckRegions(
    absl::string_view who, std::vector<RegionDecl> regions) {
  for (const RegionDecl& r : regions) {
    if (r.id & kStagingBufferBit) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region id ", r.id,
          " has the top bit set (ids >= 2^31 are daemon staging; choose an "
          "id below 2^31)"));
    }
    if (r.size_bytes <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": region ", r.id, " has size_bytes ",
                       r.size_bytes, "; it must be > 0"));
    }
    if (!r.names_memory) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": region ", r.id,
                       " names no memory (shared_memory or cuda_ipc)"));
    }
  }
  std::stable_sort(
      regions.begin(), regions.end(),
      [](const RegionDecl& a, const RegionDecl& b) { return a.id < b.id; });
  for (size_t i = 1; i < regions.size(); ++i) {
    if (regions[i].id == regions[i - 1].id) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region id ", regions[i].id, " is registered twice"));
    }
  }
  return regions;
}

absl::StatusOr<RankLayout> PlacePieces(absl::string_view who,
                                       const ModelSpec& model,
                                       const std::vector<RegionDecl>& regions,
                                       std::vector<Piece> pieces) {
  RankLayout layout;
  for (const RegionDecl& r : regions) {
    layout.buffer_ids.push_back(r.id);
    layout.buffer_bytes.push_back(r.size_bytes);
  }
  for (Piece& piece : pieces) {
    if (piece.param < 0 ||
        static_cast<size_t>(piece.param) >= model.params.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": a piece refers to parameter index ", piece.param,
          ", which is not declared (", model.params.size(), " parameters)"));
    }
    auto region = std::lower_bound(
        layout.buffer_ids.begin(), layout.buffer_ids.end(), piece.buffer);
    if (region == layout.buffer_ids.end() || *region != piece.buffer) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": piece of ", model.params[piece.param].name, " box ",
          BoxToString(piece.box), " is in region ", piece.buffer,
          ", which is not registered"));
    }
    piece.buffer = static_cast<uint32_t>(region - layout.buffer_ids.begin());
    // A box whose strides would not fit in 64 bits gets none: it lies
    // outside every shape that validated, as ValidateRankPieces reports.
    if (piece.strides.empty() && ValidateShape(piece.box.extent).ok()) {
      piece.strides = RowMajorStrides(
          StorageShape(piece.box.extent, model.params[piece.param].dtype));
    }
  }
  layout.pieces = std::move(pieces);
  absl::Status s =
      ValidateRankPieces(model, layout, who, /*allow_staging=*/false);
  if (!s.ok()) return s;
  return layout;
}

}  // namespace ferry
