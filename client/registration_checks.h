// Client-side checks shared by SourceClient and DestinationClient: the
// malformed-input cases of docs/api.md's INVALID_ARGUMENT, caught before
// any RPC with a message naming the participant (`who`), the parameter and
// the box. The daemon checks the same and more (declarations that disagree
// between ranks, parameters the stream does not declare); these exist so
// that a mistake in the caller's own layout is reported where it was made.
#ifndef FERRY_CLIENT_REGISTRATION_CHECKS_H_
#define FERRY_CLIENT_REGISTRATION_CHECKS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/piece.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

// Region ids unique and < 2^31, sizes > 0, exactly one kind of memory each.
// Fills `sizes` (region id -> size_bytes).
absl::Status CheckRegions(absl::string_view who,
                          const std::vector<v1::MemoryRegion>& regions,
                          absl::flat_hash_map<uint32_t, int64_t>* sizes);

// Every parameter has a name (declared once), a dtype and a valid shape (a
// block-quantized innermost dim is whole blocks): core/validation.h's
// ValidateModelSpec, the daemon's rule, prefixed with `who`.
absl::Status CheckModel(absl::string_view who, const ModelSpec& model);

// Each piece's parameter exists, its box lies in the parameter's shape
// (block-aligned for quantized dtypes), strides have one entry per dim, and
// its bytes lie inside a region of `sizes`.
absl::Status CheckPieces(absl::string_view who, const ModelSpec& model,
                         const std::vector<Piece>& pieces,
                         const absl::flat_hash_map<uint32_t, int64_t>& sizes);

// The rank's device as registrations declare it: the GPU of its first CUDA
// IPC region, else HOST.
v1::Device DeviceOfRegions(const std::vector<v1::MemoryRegion>& regions);

}  // namespace ferry

#endif  // FERRY_CLIENT_REGISTRATION_CHECKS_H_
