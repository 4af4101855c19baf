// Converters between core/'s pure C++ model and the ferry.v1 wire messages.
//
// core/ (dtypes, boxes, pieces, engine tables) knows nothing of gRPC; the
// wire API (proto/ferry/v1/types.proto, registration.proto) mirrors it with
// names instead of indices. These functions are the one place where the two
// meet, for the client library, ferryctl and (if it wants) the daemon.
//
// Differences the converters bridge:
//   - a core Piece names its parameter by index into a ModelSpec; a wire
//     Piece by name, so converting a piece needs the ModelSpec;
//   - a core EngineParam holds its loader flags as a bit mask; the wire
//     holds a repeated LoaderFlag. An unknown wire flag or loader kind fails
//     closed (the parameter becomes fallback), as docs/api.md requires;
//   - core FusedPart::local_extent has no wire field: the daemon infers a
//     replicated part from the shapes (docs/api.md "Layouts"). It is dropped
//     by EngineTableToProto and comes back as 0 (even split).
//
// Every FromProto function validates what it cannot represent (a dtype
// number out of range, a box whose offset and extent differ in rank, an
// unknown parameter name) and returns INVALID_ARGUMENT naming it; nothing
// here checks geometry against shapes (core/validation.h does that).
//
// Threading: pure functions, thread-safe.
#ifndef FERRY_CLIENT_PROTO_CONVERT_H_
#define FERRY_CLIENT_PROTO_CONVERT_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "core/dtype.h"
#include "core/geometry.h"
#include "core/layout_resolution.h"
#include "core/piece.h"
#include "proto/ferry/v1/registration.pb.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

// DType: the numbers are equal by design (types.proto); kInvalid maps to
// DTYPE_UNSPECIFIED, which FromProto rejects.
v1::DType DTypeToProto(DType dtype);
absl::StatusOr<DType> DTypeFromProto(int wire_dtype);

v1::Box BoxToProto(const Box& box);
absl::StatusOr<Box> BoxFromProto(const v1::Box& box);

v1::ParameterSpec ParamSpecToProto(const ParamSpec& param);
absl::StatusOr<ParamSpec> ParamSpecFromProto(const v1::ParameterSpec& param);

// Every parameter of `model`, in order.
std::vector<v1::ParameterSpec> ModelSpecToProto(const ModelSpec& model);
// A ModelSpec (BuildIndex done) from declared parameters; a name declared
// twice is INVALID_ARGUMENT.
absl::StatusOr<ModelSpec> ModelSpecFromProto(
    const google::protobuf::RepeatedPtrField<v1::ParameterSpec>& params);

// piece.param must index `model`; else INVALID_ARGUMENT.
absl::StatusOr<v1::Piece> PieceToProto(const Piece& piece,
                                       const ModelSpec& model);
// piece.parameter must be declared in `model`. Empty wire strides become
// row-major contiguous strides of the box's storage shape, as the wire
// defines them.
absl::StatusOr<Piece> PieceFromProto(const v1::Piece& piece,
                                     const ModelSpec& model);

v1::LoaderKind LoaderKindToProto(LoaderKind kind);
// Unknown or UNSPECIFIED: kCustom (always fallback).
LoaderKind LoaderKindFromProto(int wire_kind);

// The parameters of `table`. tp_rank, tp_size, node and buffer sizes are
// fields of the DestinationRegistration, not of the table.
v1::EngineParameterTable EngineTableToProto(const EngineTable& table);
absl::StatusOr<EngineParam> EngineParamFromProto(
    const v1::EngineParameter& param);
// The full core table of one destination registration that carries an
// engine_table: tp_rank, tp_size, node from the registration and
// buffer_bytes[id] = the size of region id (0 where no region has that id).
// Region ids of 65536 and more are INVALID_ARGUMENT here (core indexes
// buffers by id).
absl::StatusOr<EngineTable> EngineTableFromProto(
    const v1::DestinationRegistration& registration);

}  // namespace ferry

#endif  // FERRY_CLIENT_PROTO_CONVERT_H_
