#include "client/registration_checks.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/validation.h"
#include "proto/convert.h"

namespace ferry {

absl::StatusOr<std::vector<RegionDecl>> CheckClientRegions(
    absl::string_view who, const std::vector<v1::MemoryRegion>& regions,
    absl::flat_hash_map<uint32_t, int64_t>* sizes) {
  std::vector<RegionDecl> decls;
  for (const v1::MemoryRegion& r : regions) {
    decls.push_back(RegionDeclFromProto(r));
  }
  absl::StatusOr<std::vector<RegionDecl>> checked =
      CheckRegions(who, std::move(decls));
  if (!checked.ok()) return checked.status();
  sizes->clear();
  for (const RegionDecl& r : *checked) sizes->emplace(r.id, r.size_bytes);
  return checked;
}

absl::Status CheckModel(absl::string_view who, const ModelSpec& model) {
  // The daemon's own rule (core/validation.h), so both say the same.
  absl::Status s = ValidateModelSpec(model);
  if (s.ok()) return s;
  return absl::InvalidArgumentError(absl::StrCat(who, ": ", s.message()));
}

absl::Status CheckPieces(absl::string_view who, const ModelSpec& model,
                         const std::vector<Piece>& pieces,
                         const std::vector<RegionDecl>& regions) {
  return PlacePieces(who, model, regions, pieces).status();
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
