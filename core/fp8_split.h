// FP8 in flight of a tensor split over trainer nodes (core/fp8_sources.h,
// QuantizedParam::parts): FSDP shards a tensor over ranks on several
// nodes, so no node holds all of it, and none sends its bf16 to another.
// Each node quantizes the parts it holds, exactly as if the tensor were
// whole (core/fp8_blocks.h: each block's amax combined over its holders).
// Pure; any thread.
#ifndef FERRY_CORE_FP8_SPLIT_H_
#define FERRY_CORE_FP8_SPLIT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/fp8_sources.h"
#include "core/model_spec.h"
#include "core/piece.h"

namespace ferry {

// Who quantizes which part of P (`held`: its trainer pieces in `sources`;
// `bytes`: the bytes of P each node's trainer ranks hold; `load`: what
// each node quantizes so far): none (P whole on `home`) when the trainer
// ranks on `home` hold all of it; else the pieces of `home`, then of the
// other nodes by most bytes held (then least load, then name), each piece
// taken unless it overlaps one taken already (a replica's), until they
// cover P. INVALID_ARGUMENT naming an element when they cannot (a hole,
// or replicas cut differently across nodes). The parts' ranks and offsets
// are the caller's to fill.
absl::StatusOr<std::vector<QuantizedPart>> ChooseParts(
    const ModelSpec& model, int32_t param, const std::vector<HeldPiece>& held,
    const std::vector<RankLayout>& sources,
    const std::map<std::string, int64_t>& bytes,
    const std::map<std::string, int64_t>& load, const std::string& home);

// A split tensor's quantize step on node `at`, in two phases between
// which every holder's amaxes are combined (the largest bits per block):
//
// Whether the readable pieces (`readable` as CheckReadable's) hold each
// of q's parts on `at`: OK, or FAILED_PRECONDITION naming the part.
absl::Status CheckPartsReadable(
    const ModelSpec& model, const QuantizedParam& q, const std::string& at,
    const std::vector<HeldPiece>& held,
    const std::function<bool(const HeldPiece&)>& readable);
// Phase 1: raises `max_bits` (q's block grid, row-major; zeros to start)
// to each block's max |x| over q's parts on `at`.
absl::Status PartialAmax(const ModelSpec& model, const QuantizedParam& q,
                         const std::string& at,
                         const std::vector<HeldPiece>& held,
                         const std::vector<std::vector<const uint8_t*>>& bases,
                         uint32_t* max_bits);
// Phase 2: q's parts on `at` quantized with `max_bits` (combined over
// every holder) into `fp8_buffer` at each part's offset, and, where
// `scale_buffer` is not null (`at` is q.node), the whole scale grid into
// it at q.scale_offset. REQUIRES: CheckPartsReadable is OK.
absl::Status QuantizeParts(
    const ModelSpec& model, const QuantizedParam& q, const std::string& at,
    const std::vector<HeldPiece>& held,
    const std::vector<std::vector<const uint8_t*>>& bases,
    const uint32_t* max_bits, uint8_t* fp8_buffer, uint8_t* scale_buffer);

// A block grid of max |x| bits as it travels between daemons
// (QuantizeTensor.max_bits, BlockAmaxResponse.max_bits): uint32s,
// little-endian, row-major.
std::string PackMaxBits(const std::vector<uint32_t>& bits);
// INVALID_ARGUMENT unless `packed` is exactly `blocks` uint32s.
absl::StatusOr<std::vector<uint32_t>> UnpackMaxBits(const std::string& packed,
                                                    int64_t blocks);

}  // namespace ferry

#endif  // FERRY_CORE_FP8_SPLIT_H_
