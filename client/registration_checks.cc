#include "client/registration_checks.h"

#include "absl/strings/str_cat.h"
#include "core/validation.h"

namespace ferry {

absl::Status CheckRegions(absl::string_view who,
                          const std::vector<v1::MemoryRegion>& regions,
                          absl::flat_hash_map<uint32_t, int64_t>* sizes) {
  sizes->clear();
  for (const v1::MemoryRegion& r : regions) {
    if (r.region_id() & kStagingBufferBit) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region id ", r.region_id(),
          " has the top bit set (reserved for daemon staging)"));
    }
    if (r.size_bytes() <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region ", r.region_id(), " has size ", r.size_bytes(),
          " bytes; must be > 0"));
    }
    if (r.memory_case() == v1::MemoryRegion::MEMORY_NOT_SET) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region ", r.region_id(),
          " names no memory (shared_memory or cuda_ipc)"));
    }
    if (!sizes->emplace(r.region_id(), r.size_bytes()).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": region id ", r.region_id(), " is registered twice"));
    }
  }
  return absl::OkStatus();
}

absl::Status CheckModel(absl::string_view who, const ModelSpec& model) {
  // The daemon's own rule (core/validation.h), so both say the same.
  absl::Status s = ValidateModelSpec(model);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat(who, ": ", s.message()));
}

absl::Status CheckPieces(absl::string_view who, const ModelSpec& model,
                         const std::vector<Piece>& pieces,
                         const absl::flat_hash_map<uint32_t, int64_t>& sizes) {
  for (const Piece& piece : pieces) {
    if (piece.param < 0 ||
        static_cast<size_t>(piece.param) >= model.params.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": a piece refers to parameter index ", piece.param,
          ", which is not declared (", model.params.size(), " parameters)"));
    }
    const ParamSpec& p = model.params[piece.param];
    const std::string where = absl::StrCat(who, ": piece of ", p.name, " box ",
                                           BoxToString(piece.box));
    absl::Status s = ValidateBoxInShape(piece.box, p.shape);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " is not inside its shape ", DimsToString(p.shape), ": ",
          s.message()));
    }
    if (IsBlockQuantized(p.dtype) && !piece.box.offset.empty() &&
        (piece.box.offset.back() % BlockElems(p.dtype) != 0 ||
         piece.box.extent.back() % BlockElems(p.dtype) != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " does not start and end on ", BlockElems(p.dtype),
          "-element block boundaries"));
    }
    if (!piece.strides.empty() && piece.strides.size() != piece.box.rank()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " has ", piece.strides.size(), " strides for ",
          piece.box.rank(), " dims"));
    }
    for (int64_t stride : piece.strides) {
      if (stride < 0) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " has a negative stride"));
      }
    }
    auto region = sizes.find(piece.buffer);
    if (region == sizes.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " is in region ", piece.buffer, ", which is not registered"));
    }
    if (piece.byte_offset < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " has a negative byte offset"));
    }
    Piece checked = piece;
    if (checked.strides.empty()) {
      checked.strides =
          RowMajorStrides(StorageShape(checked.box.extent, p.dtype));
    }
    absl::StatusOr<int64_t> end = PieceEndByte(checked, p.dtype);
    if (!end.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": ", end.status().message()));
    }
    if (*end > region->second) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " ends at byte ", *end, ", past the end of region ",
          piece.buffer, " (", region->second, " bytes)"));
    }
  }
  return absl::OkStatus();
}

v1::Device DeviceOfRegions(const std::vector<v1::MemoryRegion>& regions) {
  for (const v1::MemoryRegion& r : regions) {
    if (r.has_cuda_ipc()) return r.cuda_ipc().device();
  }
  v1::Device host;
  host.set_kind(v1::DEVICE_KIND_HOST);
  return host;
}

}  // namespace ferry
