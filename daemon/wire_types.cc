#include "daemon/wire_types.h"

#include "absl/strings/str_cat.h"

namespace ferry {

absl::Status ValidateName(absl::string_view field, absl::string_view value) {
  if (value.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(field, " is required"));
  }
  if (value.size() > 128) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " '", value.substr(0, 32), "...' is longer than 128 "
        "characters"));
  }
  for (char c : value) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                    (c >= '0' && c <= '9') || c == '.' || c == '_' ||
                    c == '-';
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, " '", value,
                       "' may only contain [A-Za-z0-9._-]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view who) {
  if (value <= 0 || value > static_cast<int>(DType::kQ6_K)) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": dtype ", value,
                     value == 0 ? " (DTYPE_UNSPECIFIED) is required"
                                : " is unknown to this daemon"));
  }
  return static_cast<DType>(value);
}

v1::DType DTypeToProto(DType dtype) { return static_cast<v1::DType>(dtype); }

absl::StatusOr<Dims> DimsFromProto(
    const google::protobuf::RepeatedField<int64_t>& values,
    absl::string_view what) {
  Dims dims;
  for (int64_t v : values) {
    if (v < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " has a negative entry ", v));
    }
    dims.push_back(v);
  }
  return dims;
}

absl::StatusOr<Box> BoxFromProto(const v1::Box& box, absl::string_view what) {
  if (box.offset_size() != box.extent_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": box has ", box.offset_size(), " offsets but ",
                     box.extent_size(), " extents"));
  }
  Box out;
  absl::StatusOr<Dims> offset =
      DimsFromProto(box.offset(), absl::StrCat(what, ": box offset"));
  if (!offset.ok()) return offset.status();
  absl::StatusOr<Dims> extent =
      DimsFromProto(box.extent(), absl::StrCat(what, ": box extent"));
  if (!extent.ok()) return extent.status();
  out.offset = *std::move(offset);
  out.extent = *std::move(extent);
  return out;
}

v1::Box BoxToProto(const Box& box) {
  v1::Box out;
  for (int64_t v : box.offset) out.add_offset(v);
  for (int64_t v : box.extent) out.add_extent(v);
  return out;
}

absl::Status ValidateDevice(const v1::Device& device, absl::string_view who) {
  switch (device.kind()) {
    case v1::DEVICE_KIND_HOST:
      return absl::OkStatus();
    case v1::DEVICE_KIND_CUDA:
      if (device.cuda_uuid().empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(who, ": a CUDA device needs cuda_uuid"));
      }
      return absl::OkStatus();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": device.kind is required (HOST or CUDA)"));
  }
}

}  // namespace ferry
