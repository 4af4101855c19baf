#include "daemon/registry/registration_parser.h"

#include <sys/stat.h>

#include <algorithm>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/registration_rules.h"
#include "proto/registration_convert.h"
#include "proto/request_limits.h"

namespace ferry {
namespace {

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

// Step (d) for a source: its regions mapped (after the overlap check,
// which reads the files they name), the Participant built from the checked
// registration, whose pieces are placed.
absl::StatusOr<std::unique_ptr<Participant>> MapSource(
    const v1::SourceRegistration& wire, SourceRegistration r,
    absl::string_view daemon_node, const MapOptions& mapping) {
  const std::string who = r.Who();
  absl::Status s = CheckRegionsDisjoint(wire.regions(), who, "source.regions",
                                        mapping.map_memory);
  if (!s.ok()) return s;
  absl::StatusOr<std::unique_ptr<MemoryMap>> memory =
      MemoryMap::Map(wire.regions(), who, mapping);
  if (!memory.ok()) return memory.status();
  auto p = std::make_unique<Participant>();
  p->role = Role::kSource;
  p->stream = std::move(r.stream);
  p->rank = r.rank;
  p->world_size = r.world_size;
  p->node = std::string(daemon_node);
  p->device = wire.device();
  p->pid = mapping.map_memory ? r.pid : 0;
  // The list, sharing ownership of the parsed declaration (and its index).
  const ModelSpec* const declared = r.model.get();
  p->params = std::shared_ptr<const std::vector<ParamSpec>>(
      std::move(r.model), &declared->params);
  p->pieces = std::move(r.pieces);  // `buffer`: MemoryMap's order
  p->memory = *std::move(memory);
  return p;
}

// Step (d) for a destination: as MapSource; region ids in the layout
// become MemoryMap's dense indices (every one registered: checked).
absl::StatusOr<std::unique_ptr<Participant>> MapDestination(
    const v1::DestinationRegistration& wire, DestinationRegistration r,
    absl::string_view daemon_node, const MapOptions& mapping) {
  const std::string who = r.Who();
  absl::Status s = CheckRegionsDisjoint(
      wire.regions(), who, "destination.regions", mapping.map_memory);
  if (!s.ok()) return s;
  absl::StatusOr<std::unique_ptr<MemoryMap>> memory =
      MemoryMap::Map(wire.regions(), who, mapping);
  if (!memory.ok()) return memory.status();
  const MemoryMap& map = **memory;
  auto p = std::make_unique<Participant>();
  p->role = Role::kDestination;
  p->stream = std::move(r.stream);
  p->instance_id = std::move(r.instance_id);
  p->tp_rank = r.tp_rank;
  p->tp_size = r.tp_size;
  p->held_version = r.held_version;
  p->node = std::string(daemon_node);
  p->device = wire.device();
  p->pid = mapping.map_memory ? r.pid : 0;
  p->device_staging = r.device_staging;
  p->engine_table =
      r.layout == DestinationRegistration::Layout::kEngineTable;
  for (EngineParam& e : r.engine_params) {
    e.buffer = static_cast<uint32_t>(map.IndexOf(e.buffer));
  }
  for (Piece& piece : r.pieces) {
    piece.buffer = static_cast<uint32_t>(map.IndexOf(piece.buffer));
  }
  if (p->engine_table) {
    p->engine_params = std::make_shared<const std::vector<EngineParam>>(
        std::move(r.engine_params));
  }
  p->piece_params = std::move(r.piece_params);
  p->pieces = std::move(r.pieces);
  p->regions.assign(wire.regions().begin(), wire.regions().end());
  p->memory = *std::move(memory);
  return p;
}

}  // namespace

// The registration walk: four steps, each done once, in this order.
//   (a) limits on the wire message: proto/request_limits.h;
//   (b) one conversion to the core struct: proto/registration_convert.h;
//   (c) one check of that struct: core/registration_rules.h, the call the
//       C++ client makes before sending;
//   (d) memory mapped and the Participant built: MapSource /
//       MapDestination above.
absl::StatusOr<std::unique_ptr<Participant>> ParseSourceRegistration(
    const v1::SourceRegistration& source, absl::string_view daemon_node,
    const MapOptions& mapping, DeclarationCache* declarations) {
  if (absl::Status s = CheckSourceLimits(source); !s.ok()) return s;  // (a)
  DeclarationConverter cached;
  if (declarations != nullptr) {
    cached = [declarations](const DeclaredParameters& params,
                            absl::string_view who) {
      return declarations->Parse(params, who);
    };
  }
  absl::StatusOr<SourceRegistration> r =
      SourceRegistrationFromProto(source, cached);  // (b)
  if (!r.ok()) return r.status();
  if (absl::Status s = CheckSourceRegistration(&*r, daemon_node); !s.ok()) {
    return s;  // (c)
  }
  return MapSource(source, *std::move(r), daemon_node, mapping);  // (d)
}

// The same four steps for an engine rank.
absl::StatusOr<std::unique_ptr<Participant>> ParseDestinationRegistration(
    const v1::DestinationRegistration& d, absl::string_view daemon_node,
    const MapOptions& mapping) {
  if (absl::Status s = CheckDestinationLimits(d); !s.ok()) return s;  // (a)
  absl::StatusOr<DestinationRegistration> r =
      DestinationRegistrationFromProto(d);  // (b)
  if (!r.ok()) return r.status();
  if (absl::Status s = CheckDestinationRegistration(*r, daemon_node);
      !s.ok()) {
    return s;  // (c)
  }
  return MapDestination(d, *std::move(r), daemon_node, mapping);  // (d)
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
      CheckRegions(who, RegionDeclsFromProto(all));
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
