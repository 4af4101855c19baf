// Client-side checks shared by SourceClient and DestinationClient: the
// malformed-input cases of docs/api.md's INVALID_ARGUMENT, caught before
// any RPC with a message naming the participant (`who`), the parameter and
// the box. The daemon checks the same and more (declarations that disagree
// between ranks, parameters the stream does not declare); these exist so
// that a mistake in the caller's own layout is reported where it was made.
// SourceClient and DestinationClient end with the daemon's own check of the
// whole registration (core/registration_rules.h CheckSourceRegistration /
// CheckDestinationRegistration, step (c) of its registration walk).
#ifndef FERRY_CLIENT_REGISTRATION_CHECKS_H_
#define FERRY_CLIENT_REGISTRATION_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/piece.h"
#include "core/registration_rules.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

// The rank's regions checked by core's rule (core/registration_rules.h:
// ids unique and < 2^31, sizes > 0, memory named), in its buffer order.
// Fills `sizes` (region id -> size_bytes).
absl::StatusOr<std::vector<RegionDecl>> CheckClientRegions(
    absl::string_view who, const std::vector<v1::MemoryRegion>& regions,
    absl::flat_hash_map<uint32_t, int64_t>* sizes);

// Every parameter has a name (declared once), a dtype and a valid shape (a
// block-quantized innermost dim is whole blocks): core/validation.h's
// ValidateModelSpec, the daemon's rule, prefixed with `who`.
absl::Status CheckModel(absl::string_view who, const ModelSpec& model);

// The pieces placed in the regions by core's PlacePieces, the daemon's own
// rule: parameter declared, box in its shape and on block boundaries,
// strides one per dim, bytes inside a registered region.
absl::Status CheckPieces(absl::string_view who, const ModelSpec& model,
                         const std::vector<Piece>& pieces,
                         const std::vector<RegionDecl>& regions);

// The rank's device as registrations declare it: the GPU of its first CUDA
// IPC region, else HOST.
v1::Device DeviceOfRegions(const std::vector<v1::MemoryRegion>& regions);

}  // namespace ferry

#endif  // FERRY_CLIENT_REGISTRATION_CHECKS_H_
