#include "daemon/registry/registration_parser.h"

#include <sys/stat.h>

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/limits.h"
#include "core/region_copy.h"
#include "core/registration_rules.h"
#include "core/validation.h"
#include "proto/convert.h"
#include "proto/request_limits.h"

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

std::vector<RegionDecl> RegionDeclsOf(
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions) {
  std::vector<RegionDecl> out;
  out.reserve(regions.size());
  for (const v1::MemoryRegion& r : regions) {
    out.push_back(RegionDeclFromProto(r));
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

// What a region maps, for the overlap check: the file (by inode where this
// daemon can stat it, else by the name the client gave) and the byte range
// of it, [begin, end).
struct MappedRange {
  std::string file;
  int64_t begin = 0;
  int64_t end = 0;
  int index = 0;  // into the request's regions
};

std::string FileKey(const std::string& path, const std::string& fallback,
                    bool may_stat) {
  struct stat st;
  if (may_stat && ::stat(path.c_str(), &st) == 0) {
    return absl::StrCat("inode ", st.st_dev, ":", st.st_ino);
  }
  return fallback;
}

// Regions of one participant must not map the same bytes twice (docs/api.md,
// "Memory registration"): two regions over one range of one shm object,
// memfd or CUDA allocation would let two pieces in "different" regions
// write one byte. Malformed regions are left to MemoryMap, which names them.
absl::Status CheckRegionsDisjoint(
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions,
    absl::string_view who, absl::string_view field, bool may_stat) {
  std::vector<MappedRange> ranges;
  ranges.reserve(regions.size());
  for (int i = 0; i < regions.size(); ++i) {
    const v1::MemoryRegion& r = regions[i];
    MappedRange m;
    m.index = i;
    int64_t offset = 0;
    if (r.has_shared_memory()) {
      const v1::SharedMemoryRegion& shm = r.shared_memory();
      offset = shm.file_offset_bytes();
      if (shm.has_memfd()) {
        const std::string path = absl::StrCat(
            "/proc/", shm.memfd().pid(), "/fd/", shm.memfd().fd());
        m.file = FileKey(path, "memfd " + path, may_stat);
      } else if (shm.memory_case() == v1::SharedMemoryRegion::kFilePath) {
        m.file = FileKey(shm.file_path(), "file " + shm.file_path(), may_stat);
      } else {
        const std::string& name = shm.shm_name();
        const bool one_component =
            name.size() > 1 && name[0] == '/' &&
            name.find('/', 1) == std::string::npos;
        m.file = FileKey(absl::StrCat("/dev/shm", name),
                         absl::StrCat("shm ", name), may_stat && one_component);
      }
    } else if (r.has_cuda_ipc()) {
      offset = r.cuda_ipc().allocation_offset_bytes();
      m.file = absl::StrCat("cuda ", r.cuda_ipc().ipc_handle());
    } else {
      continue;
    }
    if (offset < 0 || r.size_bytes() <= 0 ||
        !CheckedAdd(offset, r.size_bytes(), &m.end)) {
      continue;
    }
    m.begin = offset;
    ranges.push_back(std::move(m));
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const MappedRange& a, const MappedRange& b) {
              return std::tie(a.file, a.begin, a.index) <
                     std::tie(b.file, b.begin, b.index);
            });
  // The range reaching furthest so far: any later one starting before its
  // end overlaps it.
  for (size_t i = 1, far = 0; i < ranges.size(); ++i) {
    if (ranges[i].file != ranges[i - 1].file) {
      far = i;
      continue;
    }
    const MappedRange& a = ranges[far];
    const MappedRange& b = ranges[i];
    if (b.begin < a.end) {
      const int first = std::min(a.index, b.index);
      const int second = std::max(a.index, b.index);
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": ", field, "[", first, "] (region ",
          regions[first].region_id(), ") and ", field, "[", second,
          "] (region ", regions[second].region_id(), ") both map bytes [",
          b.begin, ", ", std::min(a.end, b.end),
          ") of the same memory; regions of a rank must not overlap"));
    }
    if (b.end > a.end) far = i;
  }
  return absl::OkStatus();
}

// Bytes a piece addresses (box bytes), summed; saturates at int64 max.
int64_t AddSaturated(int64_t a, int64_t b) {
  int64_t out;
  return CheckedAdd(a, b, &out) ? out : INT64_MAX;
}

// Engine parameters of one rank must not share bytes, except an alias
// (EngineParameter.alias_of), which must be exactly its target's bytes:
// tied embeddings are written once, through the target. REQUIRES: every
// parameter placed (PlacedEngineParam: inside its region, dense buffers).
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

}  // namespace

absl::StatusOr<std::unique_ptr<Participant>> ParseSourceRegistration(
    const v1::SourceRegistration& source, absl::string_view daemon_node,
    const MapOptions& mapping, DeclarationCache* declarations) {
  // Limits first: nothing below runs on a request past them.
  absl::Status s = CheckSourceLimits(source);
  if (!s.ok()) return s;
  const std::string source_who =
      absl::StrCat("source ", source.stream(), " rank ", source.rank());
  if (source.world_size() > kMaxRanks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "source ", source.stream(), " rank ", source.rank(), ": world_size ",
        source.world_size(), " is more than ", kMaxRanks, " ranks"));
  }
  if (absl::Status r = CheckRankInGroup(source_who, "rank", source.rank(),
                                        "world_size", source.world_size());
      !r.ok()) {
    return r;
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

  absl::StatusOr<std::shared_ptr<const ModelSpec>> spec =
      declarations != nullptr
          ? declarations->Parse(source.parameters(), who)
          : ParseDeclaration(source.parameters(), who);
  if (!spec.ok()) return spec.status();
  const ModelSpec* const declared = spec->get();
  absl::StatusOr<std::vector<RegionDecl>> regions =
      CheckRegions(who, RegionDeclsOf(source.regions()));
  if (!regions.ok()) return regions.status();

  std::vector<Piece> pieces;
  pieces.reserve(source.pieces_size());
  for (const v1::Piece& wire : source.pieces()) {
    absl::StatusOr<Piece> piece = PieceFieldsFromProto(wire, who);
    if (!piece.ok()) return piece.status();
    piece->param = declared->Find(wire.parameter());
    if (piece->param < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": piece of ", wire.parameter(), " box ",
          BoxToString(piece->box),
          ": the rank does not declare that parameter (list it in "
          "parameters)"));
    }
    pieces.push_back(*std::move(piece));
  }
  // Boxes, block alignment, strides and bytes inside the regions: the rule
  // the client libraries apply too (core/registration_rules.h). `buffer`
  // becomes the dense index, the order MemoryMap maps the regions in.
  absl::StatusOr<RankLayout> layout =
      PlacePieces(who, *declared, *regions, std::move(pieces));
  if (!layout.ok()) return layout.status();
  // What the pieces describe, against what the regions hold: pieces may
  // share bytes (tied weights, a zero-stride broadcast), but not describe
  // terabytes over a small region (planning and staging follow the boxes).
  int64_t region_bytes = 0, described = 0;
  for (const RegionDecl& r : *regions) {
    region_bytes = AddSaturated(region_bytes, r.size_bytes);
  }
  for (const Piece& piece : layout->pieces) {
    described = AddSaturated(
        described, BoxBytes(piece.box, declared->params[piece.param].dtype));
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
  s = CheckRegionsDisjoint(source.regions(), who, "source.regions",
                           mapping.map_memory);
  if (!s.ok()) return s;

  absl::StatusOr<std::unique_ptr<MemoryMap>> memory =
      MemoryMap::Map(source.regions(), who, mapping);
  if (!memory.ok()) return memory.status();
  // The list, sharing ownership of the parsed declaration (and its index).
  p->params = std::shared_ptr<const std::vector<ParamSpec>>(
      *spec, &declared->params);
  p->pieces = std::move(layout->pieces);
  p->memory = *std::move(memory);
  return p;
}

absl::StatusOr<std::unique_ptr<Participant>> ParseDestinationRegistration(
    const v1::DestinationRegistration& d, absl::string_view daemon_node,
    const MapOptions& mapping) {
  // Limits first: nothing below runs on a request past them.
  absl::Status s = CheckDestinationLimits(d);
  if (!s.ok()) return s;
  if (d.tp_size() > kMaxRanks) {
    return absl::InvalidArgumentError(
        absl::StrCat("instance ", d.instance_id(), " tp rank ", d.tp_rank(),
                     ": tp_size ", d.tp_size(), " is more than ", kMaxRanks,
                     " ranks"));
  }
  if (absl::Status r = CheckRankInGroup(
          absl::StrCat("instance ", d.instance_id(), " tp rank ", d.tp_rank()),
          "tp_rank", d.tp_rank(), "tp_size", d.tp_size());
      !r.ok()) {
    return r;
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
  if (!v1::StagingPlacement_IsValid(d.staging())) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": staging ", d.staging(), " is not a placement"));
  }
  if (d.staging() == v1::STAGING_PLACEMENT_DEVICE &&
      d.device().kind() != v1::DEVICE_KIND_CUDA) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": staging DEVICE needs the rank's device to be CUDA (its "
             "fallback tensors are staged on its GPU); a host rank's staging "
             "is host memory"));
  }
  p->device_staging = d.staging() == v1::STAGING_PLACEMENT_DEVICE;
  if (d.layout_case() == v1::DestinationRegistration::LAYOUT_NOT_SET) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": a layout is required (engine_table or explicit_pieces)"));
  }

  if (absl::StatusOr<std::vector<RegionDecl>> regions =
          CheckRegions(who, RegionDeclsOf(d.regions()));
      !regions.ok()) {
    return regions.status();
  }
  s = CheckRegionsDisjoint(d.regions(), who, "destination.regions",
                           mapping.map_memory);
  if (!s.ok()) return s;
  if (d.has_explicit_pieces()) {
    // No dtype here (the stream declares it), but a zero stride along a
    // dimension of extent > 1 writes several elements onto one byte
    // whatever the dtype. The full check (strides, pieces sharing bytes)
    // runs when the plan is built (core/validation.h).
    for (int i = 0; i < d.explicit_pieces().pieces_size(); ++i) {
      const v1::Piece& wire = d.explicit_pieces().pieces(i);
      for (int k = 0; k < wire.strides_size() && k < wire.box().extent_size();
           ++k) {
        if (wire.strides(k) == 0 && wire.box().extent(k) > 1) {
          return absl::InvalidArgumentError(absl::StrCat(
              who, ": destination.explicit_pieces.pieces[", i, "].strides[",
              k, "] is 0 along a dimension of extent ", wire.box().extent(k),
              " (piece of ", Quote(wire.parameter()),
              "): a destination piece may not put two elements on one "
              "byte"));
        }
      }
    }
  }

  absl::StatusOr<std::unique_ptr<MemoryMap>> memory =
      MemoryMap::Map(d.regions(), who, mapping);
  if (!memory.ok()) return memory.status();
  const MemoryMap& map = **memory;

  if (d.layout_case() == v1::DestinationRegistration::kEngineTable) {
    p->engine_table = true;
    std::vector<EngineParam> table;
    absl::flat_hash_set<std::string> names;
    for (const v1::EngineParameter& ep : d.engine_table().parameters()) {
      absl::StatusOr<EngineParam> param = PlacedEngineParam(ep, who, map);
      if (!param.ok()) return param.status();
      if (!names.insert(param->name).second) {
        return absl::InvalidArgumentError(absl::StrCat(
            who, ": engine parameter ", param->name, " appears twice"));
      }
      table.push_back(*std::move(param));
    }
    s = CheckEngineParamsDisjoint(table, who);
    if (!s.ok()) return s;
    p->engine_params =
        std::make_shared<const std::vector<EngineParam>>(std::move(table));
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
  p->regions.assign(d.regions().begin(), d.regions().end());
  p->memory = *std::move(memory);
  return p;
}

absl::StatusOr<RemappedRegions> RemapRegions(
    absl::string_view who, const std::vector<v1::MemoryRegion>& registered,
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& updated,
    const MapOptions& mapping) {
  if (updated.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": UpdateRegions lists no region"));
  }
  google::protobuf::RepeatedPtrField<v1::MemoryRegion> all;
  for (const v1::MemoryRegion& r : registered) *all.Add() = r;
  std::set<uint32_t> seen;
  for (int i = 0; i < updated.size(); ++i) {
    const v1::MemoryRegion& u = updated[i];
    if (!seen.insert(u.region_id()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": UpdateRegions lists region ", u.region_id(), " twice"));
    }
    v1::MemoryRegion* old = nullptr;
    for (v1::MemoryRegion& r : all) {
      if (r.region_id() == u.region_id()) old = &r;
    }
    if (old == nullptr) {
      return absl::NotFoundError(absl::StrCat(
          who, ": region ", u.region_id(), " was never registered; "
          "UpdateRegions replaces the handles of registered regions (a new "
          "layout needs Lifecycle.SwapModel)"));
    }
    if (u.size_bytes() != old->size_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region ", u.region_id(), " has size_bytes ", u.size_bytes(),
          " but was registered with ", old->size_bytes(),
          "; a region keeps its size (a new layout needs "
          "Lifecycle.SwapModel)"));
    }
    if (u.memory_case() != old->memory_case()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region ", u.region_id(), " was registered as ",
          old->memory_case() == v1::MemoryRegion::kCudaIpc ? "GPU memory"
                                                           : "shared memory",
          " and must stay so"));
    }
    *old = u;
  }
  absl::StatusOr<std::vector<RegionDecl>> decls =
      CheckRegions(who, RegionDeclsOf(all));
  if (!decls.ok()) return decls.status();
  absl::Status s = CheckRegionsDisjoint(all, who, "regions", mapping.map_memory);
  if (!s.ok()) return s;
  absl::StatusOr<std::unique_ptr<MemoryMap>> memory =
      MemoryMap::Map(all, who, mapping);
  if (!memory.ok()) return memory.status();
  RemappedRegions out;
  out.memory = *std::move(memory);
  out.regions.assign(all.begin(), all.end());
  return out;
}

}  // namespace ferry
