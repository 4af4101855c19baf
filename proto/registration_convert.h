// A registration's wire message converted, once, to its core struct
// (core/registration.h): the second of a registration's four steps
// (limits, convert, check, map: daemon/registry/registration_parser.h).
//
// Converting fails only on what the core struct cannot hold (a device
// without its kind or uuid, a staging placement this build does not know,
// a dtype number out of range, a malformed box or stride list, a piece of
// a parameter the rank does not declare), INVALID_ARGUMENT naming the rank
// and the field. What the values must be is core/registration_rules.h's.
// The memory handles stay on the wire message, for the daemon's MemoryMap.
//
// Threading: pure functions, thread-safe (a DeclarationConverter must be
// too).
#ifndef FERRY_PROTO_REGISTRATION_CONVERT_H_
#define FERRY_PROTO_REGISTRATION_CONVERT_H_

#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/model_spec.h"
#include "core/registration.h"
#include "google/protobuf/repeated_field.h"
#include "proto/ferry/v1/registration.pb.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

using DeclaredParameters =
    google::protobuf::RepeatedPtrField<v1::ParameterSpec>;

// A trainer rank's declaration as a ModelSpec (BuildIndex done), validated
// (core/validation.h ValidateModelSpec): a declaration is checked where it
// is converted, so that a cache of converted ones (the daemon's
// DeclarationCache) skips both. Errors name `who` and the parameter.
absl::StatusOr<std::shared_ptr<const ModelSpec>> DeclarationFromProto(
    const DeclaredParameters& params, absl::string_view who);

// Converts a declaration: DeclarationFromProto, or a cache of its results.
using DeclarationConverter =
    std::function<absl::StatusOr<std::shared_ptr<const ModelSpec>>(
        const DeclaredParameters& params, absl::string_view who)>;

// Every region's id, size and whether it names memory (convert.h
// RegionDeclFromProto), in the request's order.
std::vector<RegionDecl> RegionDeclsFromProto(
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& regions);

// `declarations` null: DeclarationFromProto. Pieces name their parameter
// by index into the converted model.
absl::StatusOr<SourceRegistration> SourceRegistrationFromProto(
    const v1::SourceRegistration& source,
    const DeclarationConverter& declarations = nullptr);

absl::StatusOr<DestinationRegistration> DestinationRegistrationFromProto(
    const v1::DestinationRegistration& destination);

}  // namespace ferry

#endif  // FERRY_PROTO_REGISTRATION_CONVERT_H_
