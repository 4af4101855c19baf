// Registration rules: what a rank's place in its group must be, what its
// memory regions must be and where its pieces must lie, the same for the
// client libraries (which check before sending) and the daemon (which
// checks what arrives). One definition, so the two never disagree and a
// user sees the same message from either. The wire form is converted to
// these core types first (proto/convert.h); the rules see no proto.
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

namespace ferry {

// A group of `size` ranks (a trainer's world_size, an instance's tp_size)
// and one rank of it: INVALID_ARGUMENT "<who>: <size_name> 0 must be >= 1"
// or "<who>: <rank_name> 5 is outside [0, 4)".
absl::Status CheckRankInGroup(absl::string_view who,
                              absl::string_view rank_name, int64_t rank,
                              absl::string_view size_name, int64_t size);

// One memory region as a registration declares it.
struct RegionDecl {
  uint32_t id = 0;            // the client's region id
  int64_t size_bytes = 0;
  bool names_memory = false;  // shared memory or a CUDA IPC allocation
};

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

}  // namespace ferry

#endif  // FERRY_CORE_REGISTRATION_RULES_H_
