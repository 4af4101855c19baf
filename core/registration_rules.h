// Registration rules: what a rank's place in its group must be, what its
// memory regions must be and where its pieces and engine parameters must
// lie, the same for the client libraries (which check before sending) and
// the daemon (which checks what arrives). One definition, so the two never
// disagree and a user sees the same message from either. The wire form is
// converted to core/registration.h's structs first
// (proto/registration_convert.h); the rules see no proto.
//
// CheckSourceRegistration / CheckDestinationRegistration are the third of a
// registration's four steps (limits, convert, check, map: the walk is listed
// in daemon/registry/registration_parser.h); the rest are their parts,
// which the client calls on its own too.
//
// Pure; any thread.
#ifndef FERRY_CORE_REGISTRATION_RULES_H_
#define FERRY_CORE_REGISTRATION_RULES_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/model_spec.h"
#include "core/piece.h"
#include "core/registration.h"

namespace ferry {

// A group of `size` ranks (a trainer's world_size, an instance's tp_size)
// and one rank of it: INVALID_ARGUMENT "<who>: <size_name> 0 must be >= 1"
// or "<who>: <rank_name> 5 is outside [0, 4)".
absl::Status CheckRankInGroup(absl::string_view who,
                              absl::string_view rank_name, int64_t rank,
                              absl::string_view size_name, int64_t size);

// Region ids unique and below 2^31 (the top bit is daemon staging), sizes
// > 0, each naming memory. Returns the regions sorted by id: a region's
// buffer index is its position there, the order the daemon maps them in.
absl::StatusOr<std::vector<RegionDecl>> CheckRegions(
    absl::string_view who, std::vector<RegionDecl> regions);

// A rank's pieces, whose `buffer` is a client region id, placed in its
// regions (the result of CheckRegions): `buffer` becomes the dense index,
// empty strides become row-major contiguous, and the layout passes
// core/validation.h's ValidateRankPieces (parameter known, box in its
// shape and on block boundaries, bytes inside the region). A piece in a
// region the rank did not declare is INVALID_ARGUMENT naming it.
absl::StatusOr<RankLayout> PlacePieces(absl::string_view who,
                                       const ModelSpec& model,
                                       const std::vector<RegionDecl>& regions,
                                       std::vector<Piece> pieces);

// Everything a trainer rank's registration must be on its own (the checks
// that need the other ranks are the daemon's Registry): world_size at most
// 65536 ranks and the rank inside it, `node` (when set) equal to
// `daemon_node` (when known: empty, as in the client, skips it), pid >= 0,
// the regions (CheckRegions), the pieces (PlacePieces) and at most
// Limits::kMaxDescribedBytesPerRegionByte bytes described per region byte.
// REQUIRES: r->model validated (core/registration.h). On success the
// pieces are placed in the regions, in place (no copy of a 100,000-piece
// list): `buffer` the dense index, the order the daemon maps the regions
// in, and empty strides filled; on error r->pieces is unspecified.
// INVALID_ARGUMENT naming the rank, the field, the parameter and the box.
absl::Status CheckSourceRegistration(SourceRegistration* r,
                                     absl::string_view daemon_node = {});

// Everything an engine rank's registration must be on its own: tp_size at
// most 65536 ranks and tp_rank inside it, `node` as above, pid and
// held_version >= 0, staging DEVICE only on a CUDA rank, a layout, the
// regions (CheckRegions); explicit pieces in registered regions and with
// no zero stride along an extent > 1 (the rest of their check needs the
// stream's dtypes: core/validation.h, when the plan is built); engine
// parameters named once, inside their regions, their bytes disjoint but
// for an alias_of, which must be exactly its target's bytes, and their FP8
// declarations as CheckFp8Declarations (core/layout_resolution.h) says.
absl::Status CheckDestinationRegistration(const DestinationRegistration& r,
                                          absl::string_view daemon_node = {});

}  // namespace ferry

#endif  // FERRY_CORE_REGISTRATION_RULES_H_
