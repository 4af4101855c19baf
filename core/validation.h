// Validation of a model's parameters and of the pieces ranks register.
//
// The planner trusts what passes here, so everything a client sends is
// checked before it is used: shapes and boxes (overflow, bounds, rank),
// block alignment of quantized dtypes, pieces inside their registered
// buffers, and, for sources, that the pieces of every parameter tile it
// exactly: no gap, and no overlap except between true replicas (identical
// boxes held by different ranks, as DP replicas are). Every error is
// INVALID_ARGUMENT and names the parameter, the rank and the box.
#ifndef FERRY_CORE_VALIDATION_H_
#define FERRY_CORE_VALIDATION_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/geometry.h"
#include "core/piece.h"

namespace ferry {

// Where a piece lives: the index of its rank in the layout vector it came
// from, and its index in that rank's pieces.
struct PieceRef {
  int32_t rank_index = 0;
  int32_t piece_index = 0;
};

// One distinct box of a parameter and every rank that holds it.
struct SourceShard {
  Box box;
  std::vector<PieceRef> holders;  // replicas, sorted by rank
};

// Source pieces indexed by parameter: shards sorted by box, tiling it.
struct SourceIndex {
  std::vector<std::vector<SourceShard>> shards_by_param;
  // Per parameter: the first dimension along which its shards' offsets
  // differ (0 when none do) and the largest shard extent along it. The
  // shards agree on every earlier dimension, so their box order is their
  // order along this one.
  std::vector<int32_t> sweep_dim;
  std::vector<int64_t> max_sweep_extent;
  // Per parameter: 1 when some shard of it has several holders (DP
  // replicas), so that the planner has a holder to choose.
  std::vector<uint8_t> replicated;

  // [first, last) of shards_by_param[param], in order, holding every shard
  // that intersects `box` (a box of the parameter; an empty box gets every
  // shard). Binary search: O(log shards) plus the run, where scanning every
  // shard per destination piece made a many-shard parameter quadratic.
  std::pair<size_t, size_t> ShardRange(int32_t param, const Box& box) const;

  // Calls visit(shard, part) for every shard of `piece`'s parameter that
  // shares elements with it, in shard order: `part` is the part of the
  // piece the shard holds, or null when the shard holds the whole piece
  // (TP-matched layouts, whole experts: no box is built, and as shards
  // are disjoint no other one overlaps it). The planner's walk and the
  // cluster model's sender bound both go through here.
  template <typename Visit>
  void ForEachShardOf(const Piece& piece, const Visit& visit) const {
    const std::vector<SourceShard>& shards = shards_by_param[piece.param];
    const auto [first, last] = ShardRange(piece.param, piece.box);
    for (size_t k = first; k < last; ++k) {
      const SourceShard& shard = shards[k];
      if (Contains(shard.box, piece.box)) {
        visit(shard, static_cast<Box*>(nullptr));
        return;
      }
      std::optional<Box> part = Intersect(shard.box, piece.box);
      if (part) visit(shard, &*part);
    }
  }
};

// Names unique, dtypes known, shapes valid, block-quantized innermost dims
// whole blocks.
absl::Status ValidateModelSpec(const ModelSpec& model);

// Checks one rank's pieces against the model and its buffers. `who` names
// the rank in messages ("trainer rank 3", "instance r0 rank 1").
// `allow_staging`: destinations may name daemon staging buffers.
absl::Status ValidateRankPieces(const ModelSpec& model, const RankLayout& rank,
                                absl::string_view who, bool allow_staging);

// Validates every source rank (distinct rank ids) and that the sources tile
// every parameter of the model exactly. REQUIRES: ValidateModelSpec passed.
absl::StatusOr<SourceIndex> ValidateSources(
    const ModelSpec& model, const std::vector<RankLayout>& ranks);

// One destination rank's pieces, after ValidateRankPieces: no piece puts
// two of its elements on one byte (strides, core/byte_overlap.h: a zero
// stride along a dimension of extent > 1 is refused), no two pieces of one
// parameter claim the same element, and no two pieces write the same byte
// of a buffer (staging buffers hold one tensor each and are not compared).
// INVALID_ARGUMENT naming both pieces; RESOURCE_EXHAUSTED when pieces
// interleave so finely that proving them disjoint would take more than
// `max_proof_runs` contiguous runs (one budget for the rank's parameters
// and its buffers together).
absl::Status ValidateDestinationRank(const ModelSpec& model,
                                     const RankLayout& rank,
                                     absl::string_view who,
                                     int64_t max_proof_runs);

// Validates an instance's ranks (distinct rank ids; pieces in bounds;
// ValidateDestinationRank with Limits::kMaxOverlapProofRuns).
absl::Status ValidateDestination(const ModelSpec& model,
                                 const std::vector<RankLayout>& ranks,
                                 absl::string_view instance);

}  // namespace ferry

#endif  // FERRY_CORE_VALIDATION_H_
