// FP8 in flight as sources (docs/architecture.md, "FP8 in flight: how the
// data path will carry it"): quantization turned into something the
// planner already plans.
//
// Resolution gives each destination rank QuantizedTargets: whole blocks of
// a bf16 (f16, f32) checkpoint tensor P, with where the FP8 elements and
// the scales go. AddFp8Sources turns them into ordinary plan inputs:
//   - two derived parameters per (P, format, block): P's elements in the
//     FP8 format (P's shape) and its scales (f32, the block grid), after
//     the model's own parameters (their ids do not change);
//   - one quantizer rank per node that quantizes: a source rank holding
//     every derived tensor quantized on that node, whole and contiguous
//     (FP8 tensors in its buffer 0, scales in buffer 1). P is quantized on
//     a node whose trainer ranks hold most of its bytes, so a block that
//     straddles trainer ranks of that node is assembled there, once, and
//     never crosses the network in bf16; among such nodes (DP replicas),
//     the one with the least to quantize so far, so replicas share the
//     work and the sending. Where that node lacks some of P (FSDP over
//     several nodes), P is split: each other node quantizes the parts it
//     holds, with amaxes combined per block, and no bf16 crosses either
//     (QuantizedParam::parts);
//   - each target as two destination pieces of the derived parameters,
//     and each quantized fallback (FallbackTensor::quantized) as one piece
//     of the whole derived tensor in its staging buffer.
// The planner then plans FP8 bytes and scales from the quantizer ranks like
// any source's. QuantizeParam is the quantize step: P assembled from the
// trainer ranks' pieces and quantized into the quantizer rank's buffers.
//
// Only 2-D checkpoint tensors are quantized (UNIMPLEMENTED otherwise: the
// block rule's routines take [rows, cols]). Pure; any thread.
#ifndef FERRY_CORE_FP8_SOURCES_H_
#define FERRY_CORE_FP8_SOURCES_H_

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/layout_resolution.h"
#include "core/model_spec.h"
#include "core/piece.h"

namespace ferry {

// A part of a split tensor: a box of P that one node's trainer ranks hold
// and that node quantizes, its FP8 elements row-major over the box in that
// node's quantizer rank's buffer 0.
struct QuantizedPart {
  std::string node;
  int32_t source_rank = -1;  // that node's quantizer rank
  Box box;                   // of P
  int64_t fp8_offset = 0;    // bytes into its buffer 0
};

// One checkpoint tensor quantized in flight, and where its derived
// parameters live.
struct QuantizedParam {
  int32_t param = -1;  // the checkpoint tensor P
  DType format = DType::kF8E4M3;
  int64_t block_rows = 128;
  int64_t block_cols = 128;
  int32_t fp8_param = -1;    // derived: P's elements in `format`
  int32_t scale_param = -1;  // derived: its scales (f32, the block grid)
  std::string node;          // where it is quantized
  int32_t source_rank = -1;  // its quantizer rank, index into `sources`
  int64_t fp8_offset = 0;    // bytes into that rank's buffer 0
  int64_t scale_offset = 0;  // bytes into its buffer 1
  // Empty: P is quantized whole on `node` (its trainer ranks there hold
  // all of it), the FP8 tensor at fp8_offset. Else P is split: its
  // trainer ranks span nodes (FSDP over several nodes), each part is
  // quantized where it is held with every block's amax combined over the
  // nodes (core/fp8_blocks.h), and `node`, the one holding most of P,
  // keeps the scales (fp8_offset unused).
  std::vector<QuantizedPart> parts;

  bool split() const { return !parts.empty(); }
  // Whether `at` quantizes some of P: the node of a whole tensor, a
  // split tensor's part's.
  bool QuantizedOn(const std::string& at) const;
};

struct Fp8Sources {
  ModelSpec model;                  // the model, then the derived params
  std::vector<RankLayout> sources;  // the trainer's, then quantizer ranks
  std::vector<QuantizedParam> quantized;  // in (P, format, block) order
};

// Whether `r` receives anything quantized in flight: quantized targets,
// or quantized fallbacks (FallbackTensor::quantized).
bool ReceivesQuantized(const ResolvedInstance& r);

// From the stream's model and trainer ranks and each instance's
// resolution: the derived parameters, the quantizer ranks, and, appended
// to `layouts[i]` (instance i's ranks, by TP rank), the pieces its
// targets become. `resolved[i]` may be null (explicit pieces). With no
// target anywhere, the model and sources come back unchanged.
// INVALID_ARGUMENT for a target whose parameter the model lacks or no
// trainer rank holds; UNIMPLEMENTED for one that is not 2-D.
absl::StatusOr<Fp8Sources> AddFp8Sources(
    const ModelSpec& model, const std::vector<RankLayout>& sources,
    const std::vector<const ResolvedInstance*>& resolved,
    std::vector<std::vector<RankLayout>>* layouts);

// A trainer rank's piece of a quantized tensor.
struct HeldPiece {
  int32_t rank = -1;  // index into the sources
  const Piece* piece = nullptr;
};

// For each of `quantized` (AddFp8Sources'), the pieces of its tensor the
// sources hold, found in one pass over them: what CheckReadable and
// QuantizeParam read, once per plan rather than a search per tensor.
std::vector<std::vector<HeldPiece>> HeldPieces(
    const std::vector<QuantizedParam>& quantized,
    const std::vector<RankLayout>& sources);

// The base of `h`'s buffer in `bases` (by rank, by buffer: see below), or
// null where it is not readable here.
const uint8_t* BaseOf(const HeldPiece& h,
                      const std::vector<std::vector<const uint8_t*>>& bases);

// Whether the trainer ranks readable here cover every element of `q`'s
// tensor (`held`: HeldPieces' entry for it; `bases[r][b]`:
// the base of trainer rank r's buffer b, null where it is not readable:
// on another node, or in GPU memory): OK, or FAILED_PRECONDITION naming
// the first element none holds. It depends on the layouts only, so a
// caller asks once per plan, not per version.
absl::Status CheckReadable(const ModelSpec& model, const QuantizedParam& q,
                           const std::vector<HeldPiece>& held,
                           const std::vector<std::vector<const uint8_t*>>& bases);

// The same over a predicate: whether a piece can be read (a caller that
// copies GPU pieces to the host first counts those too).
absl::Status CheckReadable(const ModelSpec& model, const QuantizedParam& q,
                           const std::vector<HeldPiece>& held,
                           const std::function<bool(const HeldPiece&)>& readable);

// The quantize step of `q`: its tensor assembled from the trainer ranks'
// pieces (`held` and `bases` as above) and quantized into `fp8_buffer` + q.fp8_offset
// and `scale_buffer` + q.scale_offset (the quantizer rank's buffers 0 and
// 1). REQUIRES: CheckReadable(model, q, held, bases) is OK.
absl::Status QuantizeParam(const ModelSpec& model, const QuantizedParam& q,
                           const std::vector<HeldPiece>& held,
                           const std::vector<std::vector<const uint8_t*>>& bases,
                           uint8_t* fp8_buffer, uint8_t* scale_buffer);

}  // namespace ferry

#endif  // FERRY_CORE_FP8_SOURCES_H_
