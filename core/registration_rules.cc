#include "core/registration_rules.h"

#include <algorithm>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/geometry.h"
#include "core/limits.h"
#include "core/region_copy.h"
#include "core/validation.h"

namespace ferry {
namespace {

// The daemon keeps per-rank state for a whole stream or instance as soon as
// one rank registers (Registry::Snapshot, the plan cache's list of missing
// ranks), so a rank count is bounded before anything is sized by it: one
// registration claiming world_size 2^29 would otherwise cost 8 GiB.
constexpr int32_t kMaxRanks = 65536;

absl::Status CheckNode(absl::string_view who, const std::string& node,
                       absl::string_view daemon_node) {
  if (!daemon_node.empty() && !node.empty() && node != daemon_node) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": registered with the daemon of node ", daemon_node,
        " but says it runs on node ", node,
        "; register with the ferryd on your own node"));
  }
  return absl::OkStatus();
}

// Bytes a piece addresses (box bytes), summed; saturates at int64 max.
int64_t AddSaturated(int64_t a, int64_t b) {
  int64_t out;
  return CheckedAdd(a, b, &out) ? out : INT64_MAX;
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

// `length` bytes at `offset` of region `id`, inside it. `regions` sorted by
// id (CheckRegions). The messages are the daemon's MemoryMap::CheckRange's.
absl::Status CheckInRegion(const std::vector<RegionDecl>& regions,
                           uint32_t id, int64_t offset, int64_t length,
                           absl::string_view who, absl::string_view what) {
  auto region = std::lower_bound(
      regions.begin(), regions.end(), id,
      [](const RegionDecl& r, uint32_t v) { return r.id < v; });
  if (region == regions.end() || region->id != id) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", what, " is in region ", id,
                     ", which the rank did not register"));
  }
  int64_t end;
  if (offset < 0 || length < 0 || !CheckedAdd(offset, length, &end)) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", what, " has a negative or overflowing byte range"));
  }
  if (end > region->size_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": ", what, " ends at byte ", end, ", past the end of region ",
        id, " (", region->size_bytes, " bytes)"));
  }
  return absl::OkStatus();
}

// Bytes described by the pieces against the bytes the regions hold: pieces
// may share bytes (tied weights, a zero-stride broadcast), but not describe
// terabytes over a small region (planning and staging follow the boxes).
absl::Status CheckDescribedBytes(const std::string& who,
                                 const ModelSpec& model,
                                 const std::vector<RegionDecl>& regions,
                                 const std::vector<Piece>& pieces) {
  int64_t region_bytes = 0, described = 0;
  for (const RegionDecl& r : regions) {
    region_bytes = AddSaturated(region_bytes, r.size_bytes);
  }
  for (const Piece& piece : pieces) {
    described = AddSaturated(
        described, BoxBytes(piece.box, model.params[piece.param].dtype));
  }
  int64_t allowed;
  if (!CheckedMul(region_bytes, Limits::kMaxDescribedBytesPerRegionByte,
                  &allowed)) {
    allowed = INT64_MAX;
  }
  if (described > allowed) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": source.pieces describe ", described, " bytes, more than ",
        Limits::kMaxDescribedBytesPerRegionByte, " x the ", region_bytes,
        " bytes of source.regions (docs/api.md, \"Limits\")"));
  }
  return absl::OkStatus();
}

// Each engine parameter inside its region, named once. `regions` sorted.
absl::Status CheckEngineParamsPlaced(const std::string& who,
                                     const std::vector<EngineParam>& params,
                                     const std::vector<RegionDecl>& regions) {
  absl::flat_hash_set<absl::string_view> names;
  for (const EngineParam& e : params) {
    int64_t bytes;
    if (!LiveTensorBytes(e.local_shape, e.dtype, &bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": engine parameter ", e.name, ": local_shape ",
          DimsToString(e.local_shape), " overflows 64 bits"));
    }
    absl::Status s = CheckInRegion(
        regions, e.buffer, e.byte_offset, bytes, who,
        absl::StrCat("engine parameter ", e.name, " (local shape ",
                     DimsToString(e.local_shape), " ", DTypeName(e.dtype),
                     " at byte ", e.byte_offset, ")"));
    if (!s.ok()) return s;
    if (!names.insert(e.name).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": engine parameter ", e.name, " appears twice"));
    }
  }
  return absl::OkStatus();
}

// Engine parameters of one rank must not share bytes, except an alias
// (EngineParameter.alias_of), which must be exactly its target's bytes:
// tied embeddings are written once, through the target. REQUIRES: every
// parameter inside its region (CheckEngineParamsPlaced); `buffer` is a
// region id, one per region, as good as the dense index for comparing.
absl::Status CheckEngineParamsDisjoint(const std::vector<EngineParam>& params,
                                       absl::string_view who) {
  absl::flat_hash_map<absl::string_view, size_t> by_name;
  for (size_t i = 0; i < params.size(); ++i) by_name.emplace(params[i].name, i);
  struct Range {
    uint32_t buffer;
    int64_t begin, end;
    size_t index;
  };
  std::vector<Range> ranges;
  ranges.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const EngineParam& e = params[i];
    const std::string at = absl::StrCat(who, ": engine parameter ", e.name);
    if (!e.alias_of.empty()) {
      auto it = by_name.find(e.alias_of);
      if (it == by_name.end() || it->second == i) {
        return absl::InvalidArgumentError(absl::StrCat(
            at, ": alias_of ", Quote(e.alias_of),
            " names no other engine parameter of the rank"));
      }
      const EngineParam& t = params[it->second];
      if (!t.alias_of.empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            at, ": alias_of ", t.name, ", which is an alias itself (of ",
            t.alias_of, "); name ", t.alias_of, " instead"));
      }
      if (t.dtype != e.dtype || t.local_shape != e.local_shape ||
          t.buffer != e.buffer || t.byte_offset != e.byte_offset) {
        return absl::InvalidArgumentError(absl::StrCat(
            at, ": alias_of ", t.name, " must be the same bytes (same dtype, "
            "local_shape, region_id and byte_offset)"));
      }
      continue;  // its bytes are its target's, checked with the target
    }
    int64_t bytes;
    if (!LiveTensorBytes(e.local_shape, e.dtype, &bytes) || bytes == 0) {
      continue;
    }
    ranges.push_back(Range{e.buffer, e.byte_offset, e.byte_offset + bytes, i});
  }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return std::tie(a.buffer, a.begin, a.index) <
           std::tie(b.buffer, b.begin, b.index);
  });
  for (size_t i = 1, far = 0; i < ranges.size(); ++i) {
    if (ranges[i].buffer != ranges[far].buffer) {
      far = i;
      continue;
    }
    const Range& a = ranges[far];
    const Range& b = ranges[i];
    if (b.begin < a.end) {
      const EngineParam& x = params[std::min(a.index, b.index)];
      const EngineParam& y = params[std::max(a.index, b.index)];
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": engine parameters ", x.name, " (bytes [", x.byte_offset,
          ", ...)) and ", y.name, " (bytes [", y.byte_offset,
          ", ...)) overlap in their region; a destination byte is written "
          "once: declare tied parameters with alias_of"));
    }
    if (b.end > a.end) far = i;
  }
  return absl::OkStatus();
}

// Explicit destination pieces: no dtype here (the stream declares it), but
// a zero stride along a dimension of extent > 1 writes several elements
// onto one byte whatever the dtype; and each piece in a registered region.
// Bounds and pieces sharing bytes need the dtype: they are checked when the
// plan is built (core/validation.h; ExplainPlan shows failures).
absl::Status CheckExplicitPieces(const DestinationRegistration& r,
                                 const std::string& who,
                                 const std::vector<RegionDecl>& regions) {
  for (const Piece& piece : r.pieces) {
    if (piece.param < 0 ||
        static_cast<size_t>(piece.param) >= r.piece_params.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": a piece refers to parameter index ", piece.param,
          ", which is not named (", r.piece_params.size(), " names)"));
    }
  }
  for (size_t i = 0; i < r.pieces.size(); ++i) {
    const Piece& piece = r.pieces[i];
    const std::string& name = r.piece_params[piece.param];
    for (size_t k = 0; k < piece.strides.size() && k < piece.box.extent.size();
         ++k) {
      if (piece.strides[k] == 0 && piece.box.extent[k] > 1) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": destination.explicit_pieces.pieces[", i, "].strides[", k,
            "] is 0 along a dimension of extent ", piece.box.extent[k],
            " (piece of ", Quote(name),
            "): a destination piece may not put two elements on one byte"));
      }
    }
  }
  for (const Piece& piece : r.pieces) {
    auto region = std::lower_bound(
        regions.begin(), regions.end(), piece.buffer,
        [](const RegionDecl& d, uint32_t v) { return d.id < v; });
    if (region == regions.end() || region->id != piece.buffer) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": piece of ", r.piece_params[piece.param], " box ",
          BoxToString(piece.box), " is in region ", piece.buffer,
          ", which the rank did not register"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

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

absl::Status CheckSourceRegistration(SourceRegistration* r,
                                     absl::string_view daemon_node) {
  const std::string who = r->Who();
  if (r->model == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": no declaration was converted"));
  }
  if (r->world_size > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": world_size ", r->world_size, " is more than ",
                     kMaxRanks, " ranks"));
  }
  absl::Status s =
      CheckRankInGroup(who, "rank", r->rank, "world_size", r->world_size);
  if (s.ok()) s = CheckNode(who, r->node, daemon_node);
  if (!s.ok()) return s;
  if (r->pid < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": pid ", r->pid, " is negative"));
  }
  absl::StatusOr<std::vector<RegionDecl>> regions =
      CheckRegions(who, r->regions);
  if (!regions.ok()) return regions.status();
  // Boxes, block alignment, strides and bytes inside the regions.
  absl::StatusOr<RankLayout> layout =
      PlacePieces(who, *r->model, *regions, std::move(r->pieces));
  if (!layout.ok()) return layout.status();
  r->pieces = std::move(layout->pieces);
  return CheckDescribedBytes(who, *r->model, *regions, r->pieces);
}

absl::Status CheckDestinationRegistration(const DestinationRegistration& r,
                                          absl::string_view daemon_node) {
  const std::string who = r.Who();
  if (r.tp_size > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": tp_size ", r.tp_size, " is more than ", kMaxRanks,
                     " ranks"));
  }
  absl::Status s =
      CheckRankInGroup(who, "tp_rank", r.tp_rank, "tp_size", r.tp_size);
  if (s.ok()) s = CheckNode(who, r.node, daemon_node);
  if (!s.ok()) return s;
  if (r.pid < 0 || r.held_version < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": pid and held_version must not be negative"));
  }
  if (r.device_staging && !r.cuda_device) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": staging DEVICE needs the rank's device to be CUDA (its "
             "fallback tensors are staged on its GPU); a host rank's staging "
             "is host memory"));
  }
  if (r.layout == DestinationRegistration::Layout::kNone) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": a layout is required (engine_table or explicit_pieces)"));
  }
  absl::StatusOr<std::vector<RegionDecl>> regions =
      CheckRegions(who, r.regions);
  if (!regions.ok()) return regions.status();
  if (r.layout == DestinationRegistration::Layout::kExplicitPieces) {
    return CheckExplicitPieces(r, who, *regions);
  }
  s = CheckEngineParamsPlaced(who, r.engine_params, *regions);
  if (!s.ok()) return s;
  s = CheckEngineParamsDisjoint(r.engine_params, who);
  if (!s.ok()) return s;
  return CheckFp8Declarations(r.engine_params, who);
}

}  // namespace ferry
