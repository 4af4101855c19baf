// Conversions between ferry.v1 wire types (types.proto) and core/ types,
// with the checks every RPC applies to what a client sends: names, dtypes,
// shapes, boxes. Pure functions; any thread.
#ifndef FERRY_DAEMON_WIRE_TYPES_H_
#define FERRY_DAEMON_WIRE_TYPES_H_

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/geometry.h"
#include "google/protobuf/repeated_field.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

// Streams, instance ids, adapter and node names: 1 to 128 characters of
// [A-Za-z0-9._-]. INVALID_ARGUMENT naming `field`.
absl::Status ValidateName(absl::string_view field, absl::string_view value);

// A dtype the daemon knows (not UNSPECIFIED, not a newer peer's value).
absl::StatusOr<DType> DTypeFromProto(int value, absl::string_view who);
v1::DType DTypeToProto(DType dtype);

// Every entry >= 0; INVALID_ARGUMENT naming `what` otherwise.
absl::StatusOr<Dims> DimsFromProto(
    const google::protobuf::RepeatedField<int64_t>& values,
    absl::string_view what);

// Offsets and extents of equal length, none negative.
absl::StatusOr<Box> BoxFromProto(const v1::Box& box, absl::string_view what);
v1::Box BoxToProto(const Box& box);

// HOST, or CUDA with a uuid. INVALID_ARGUMENT naming `who`.
absl::Status ValidateDevice(const v1::Device& device, absl::string_view who);

}  // namespace ferry

#endif  // FERRY_DAEMON_WIRE_TYPES_H_
