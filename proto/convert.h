// Conversions between core/'s pure C++ model and the ferry.v1 wire messages
// (types.proto, registration.proto), and the checks every side applies to
// what crosses the wire: names, dtypes, dims, boxes, devices. The one place
// where the two meet: the daemon (registration parsing, events, inspection),
// the client library and ferryctl all use these functions.
//
// Differences the converters bridge:
//   - a core Piece names its parameter by index into a ModelSpec; a wire
//     Piece by name, so converting a piece needs the ModelSpec;
//   - a core EngineParam holds its loader flags as a bit mask; the wire
//     holds a repeated LoaderFlag. An unknown wire flag or loader kind fails
//     closed (the parameter becomes fallback, "unknown flags"), as
//     docs/api.md requires;
//   - FusedPart.local_extent (registration.proto field 3) travels both ways;
//     0 means an even split.
//
// Every FromProto function validates what it cannot represent (a dtype
// number out of range, a negative dim, a box whose offset and extent differ
// in rank, an unknown parameter name) and returns INVALID_ARGUMENT naming
// it, prefixed with `who` when one is given ("source policy rank 3: ...").
// Nothing here checks geometry against shapes (core/validation.h does) or
// byte ranges against memory (the daemon's MemoryMap does).
//
// Threading: pure functions, thread-safe.
#ifndef FERRY_PROTO_CONVERT_H_
#define FERRY_PROTO_CONVERT_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/geometry.h"
#include "core/layout_resolution.h"
#include "core/piece.h"
#include "core/registration.h"
#include "google/protobuf/repeated_field.h"
#include "proto/ferry/v1/registration.pb.h"
#include "proto/ferry/v1/types.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

// Streams, instance ids, adapter and node names: 1 to 128 characters of
// [A-Za-z0-9._-] (core/limits.h). INVALID_ARGUMENT "<field> '<value>' ..."
// otherwise, the value quoted bounded (core/limits.h Quote).
absl::Status ValidateName(absl::string_view field, absl::string_view value);

// HOST, or CUDA with a uuid. INVALID_ARGUMENT naming `who`.
absl::Status ValidateDevice(const v1::Device& device, absl::string_view who);

// DType: the numbers are equal by design (types.proto); kInvalid maps to
// DTYPE_UNSPECIFIED, which FromProto rejects, as it does a number from a
// newer peer.
v1::DType DTypeToProto(DType dtype);
absl::StatusOr<DType> DTypeFromProto(int wire_dtype,
                                     absl::string_view who = {});

// Every entry >= 0; INVALID_ARGUMENT naming `what` otherwise.
absl::StatusOr<Dims> DimsFromProto(
    const google::protobuf::RepeatedField<int64_t>& values,
    absl::string_view what);

// Offsets and extents of equal length, none negative.
v1::Box BoxToProto(const Box& box);
absl::StatusOr<Box> BoxFromProto(const v1::Box& box,
                                 absl::string_view what = {});

v1::ParameterSpec ParamSpecToProto(const ParamSpec& param);
absl::StatusOr<ParamSpec> ParamSpecFromProto(const v1::ParameterSpec& param,
                                             absl::string_view who = {});

// Every parameter of `model`, in order.
std::vector<v1::ParameterSpec> ModelSpecToProto(const ModelSpec& model);
// A ModelSpec (BuildIndex done) from declared parameters; a name declared
// twice is INVALID_ARGUMENT.
absl::StatusOr<ModelSpec> ModelSpecFromProto(
    const google::protobuf::RepeatedPtrField<v1::ParameterSpec>& params,
    absl::string_view who = {});

// piece.param must index `model`; else INVALID_ARGUMENT.
absl::StatusOr<v1::Piece> PieceToProto(const Piece& piece,
                                       const ModelSpec& model);
// A wire piece's own fields, checked: parameter named, box present and
// well-formed, byte_offset >= 0, strides (if any) one per dim and >= 0.
// The result's `param` is -1, `buffer` the wire region id and `strides` as
// sent (empty: row-major contiguous, to be filled once the dtype is known).
absl::StatusOr<Piece> PieceFieldsFromProto(const v1::Piece& piece,
                                           absl::string_view who);
// piece.parameter must be declared in `model`. Empty wire strides become
// row-major contiguous strides of the box's storage shape, as the wire
// defines them; negative strides, a stride count that is not the box's rank
// and a negative byte_offset are INVALID_ARGUMENT.
absl::StatusOr<Piece> PieceFromProto(const v1::Piece& piece,
                                     const ModelSpec& model,
                                     absl::string_view who = {});

// A memory region's id, size and whether it names memory, as core's
// registration rules (core/registration_rules.h) check them. Converts only.
RegionDecl RegionDeclFromProto(const v1::MemoryRegion& region);

v1::LoaderKind LoaderKindToProto(LoaderKind kind);
// Unknown or UNSPECIFIED: kCustom (always fallback).
LoaderKind LoaderKindFromProto(int wire_kind);

// Core flag bit set for a wire LoaderFlag this build does not know; core's
// resolution falls such a parameter back ("unknown flags").
constexpr uint32_t kUnknownLoaderFlagBit = 1u << 31;
uint32_t LoaderFlagsFromProto(const google::protobuf::RepeatedField<int>& flags);

// One engine parameter, `buffer` = the wire region id (the daemon maps it
// to its dense index). Checks names, dtype, dims, fused parts (named,
// local_extent >= 0) and consumes (non-empty names).
v1::EngineParameter EngineParamToProto(const EngineParam& param);
absl::StatusOr<EngineParam> EngineParamFromProto(
    const v1::EngineParameter& param, absl::string_view who = {});

// The parameters of `table`. tp_rank, tp_size, node and buffer sizes are
// fields of the DestinationRegistration, not of the table.
v1::EngineParameterTable EngineTableToProto(const EngineTable& table);
// The full core table of one destination registration that carries an
// engine_table: tp_rank, tp_size, node from the registration and
// buffer_bytes[id] = the size of region id (0 where no region has that id).
// Region ids of 65536 and more are INVALID_ARGUMENT here (core indexes
// buffers by id).
absl::StatusOr<EngineTable> EngineTableFromProto(
    const v1::DestinationRegistration& registration);

// "PREPARE", "PAUSE", "APPLY", "COMMIT", "ABORT" ("UNKNOWN" otherwise), as
// logs and error messages name update events.
const char* UpdateEventKindName(v1::UpdateEventKind kind);

}  // namespace ferry

#endif  // FERRY_PROTO_CONVERT_H_
