#include "core/validation.h"

#include <algorithm>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/byte_overlap.h"
#include "core/checked_math.h"
#include "core/limits.h"
#include "core/parallel_for.h"

namespace ferry {
namespace {

std::string Where(const ModelSpec& model, int32_t param, absl::string_view who,
                  const Box& box) {
  return absl::StrCat(who, ": piece of ", model.params[param].name, " box ",
                      BoxToString(box));
}

// Index of the first dimension along which the boxes do not all start at
// the same offset: sweeping along it separates shards quickly.
size_t SweepDim(const std::vector<const SourceShard*>& shards) {
  const size_t n = shards.front()->box.rank();
  for (size_t d = 0; d < n; ++d) {
    for (const SourceShard* s : shards) {
      if (s->box.offset[d] != shards.front()->box.offset[d]) return d;
    }
  }
  return 0;
}

// Finds some part of `whole` that no box covers, for the error message.
// Runs only on the error path.
std::optional<Box> FindGap(const Box& whole,
                           const std::vector<SourceShard>& shards) {
  std::vector<Box> remaining = {whole};
  for (const SourceShard& s : shards) {
    std::vector<Box> next;
    for (const Box& r : remaining) {
      auto cut = Intersect(r, s.box);
      if (!cut) {
        next.push_back(r);
        continue;
      }
      // r minus cut: peel slabs off dim by dim.
      Box rest = r;
      for (size_t d = 0; d < r.rank(); ++d) {
        const int64_t lo = cut->offset[d], hi = lo + cut->extent[d];
        if (rest.offset[d] < lo) {
          Box b = rest;
          b.extent[d] = lo - rest.offset[d];
          next.push_back(b);
        }
        if (rest.offset[d] + rest.extent[d] > hi) {
          Box b = rest;
          b.offset[d] = hi;
          b.extent[d] = rest.offset[d] + rest.extent[d] - hi;
          next.push_back(b);
        }
        rest.offset[d] = lo;
        rest.extent[d] = hi - lo;
      }
    }
    remaining.swap(next);
    if (remaining.empty() || remaining.size() > 4096) break;
  }
  if (remaining.empty()) return std::nullopt;
  return remaining.front();
}

// The first error of per-rank (or per-parameter) results computed side by
// side: the one a pass in index order would have returned.
absl::Status FirstError(std::vector<absl::Status>& results) {
  for (absl::Status& r : results) {
    if (!r.ok()) return std::move(r);
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateModelSpec(const ModelSpec& model) {
  // Hashed, not ordered: 140,000 names with long common prefixes made an
  // ordered set a tenth of ferryd's planning.
  absl::flat_hash_set<absl::string_view> names;
  names.reserve(model.params.size());
  for (const ParamSpec& p : model.params) {
    if (p.name.empty()) {
      return absl::InvalidArgumentError("a parameter has an empty name");
    }
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' is declared twice"));
    }
    if (p.dtype == DType::kInvalid) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' has no dtype"));
    }
    if (!IsValidDType(p.dtype)) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "' has unknown dtype number ",
                       static_cast<int>(p.dtype)));
    }
    absl::Status s = ValidateShape(p.shape, UnitBytes(p.dtype));
    if (!s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter '", p.name, "': ", s.message()));
    }
    const int64_t block = BlockElems(p.dtype);
    if (block > 1 && (p.shape.empty() || p.shape.back() % block != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter '", p.name, "' of ", DTypeName(p.dtype), " has shape ",
          DimsToString(p.shape), ": its innermost dim must be whole blocks of ",
          block, " elements"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateRankPieces(const ModelSpec& model, const RankLayout& rank,
                                absl::string_view who, bool allow_staging) {
  for (size_t i = 0; i < rank.pieces.size(); ++i) {
    const Piece& piece = rank.pieces[i];
    if (piece.param < 0 ||
        piece.param >= static_cast<int32_t>(model.params.size())) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ", piece ", i, ": unknown parameter index ",
                       piece.param));
    }
    const ParamSpec& spec = model.params[piece.param];
    absl::Status s = ValidateBoxInShape(piece.box, spec.shape);
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(model, piece.param, who, piece.box), " is not inside its shape ",
          DimsToString(spec.shape), ": ", s.message()));
    }
    const int64_t block = BlockElems(spec.dtype);
    if (block > 1 && (piece.box.offset.back() % block != 0 ||
                      piece.box.extent.back() % block != 0)) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(model, piece.param, who, piece.box),
          ": splits a ", DTypeName(spec.dtype), " block (", block,
          " elements) in the innermost dim"));
    }
    if (piece.strides.size() != piece.box.rank()) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(model, piece.param, who, piece.box), ": has ",
                       piece.strides.size(), " strides for a rank-",
                       piece.box.rank(), " box"));
    }
    if (piece.byte_offset < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(model, piece.param, who, piece.box), ": negative byte offset"));
    }
    const bool staging = (piece.buffer & kStagingBufferBit) != 0;
    if (staging && !allow_staging) {
      return absl::InvalidArgumentError(
          absl::StrCat(Where(model, piece.param, who, piece.box),
                       ": names a staging buffer, which only a destination "
                       "may receive into"));
    }
    absl::StatusOr<int64_t> end = PieceEndByte(piece, spec.dtype);
    if (!end.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          Where(model, piece.param, who, piece.box), ": ", end.status().message()));
    }
    if (!staging && !rank.buffer_bytes.empty()) {
      if (piece.buffer >= rank.buffer_bytes.size()) {
        return absl::InvalidArgumentError(
            absl::StrCat(Where(model, piece.param, who, piece.box),
                         ": buffer ", piece.buffer, " is not registered (",
                         rank.buffer_bytes.size(), " buffers)"));
      }
      if (*end > rank.buffer_bytes[piece.buffer]) {
        const std::string buffer =
            piece.buffer < rank.buffer_ids.size()
                ? absl::StrCat("region ", rank.buffer_ids[piece.buffer])
                : absl::StrCat("buffer ", piece.buffer);
        return absl::InvalidArgumentError(absl::StrCat(
            Where(model, piece.param, who, piece.box), " ends at byte ", *end,
            ", past the end of ", buffer, " (",
            rank.buffer_bytes[piece.buffer], " bytes)"));
      }
    }
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckDistinctRanks(const std::vector<RankLayout>& ranks,
                                absl::string_view group) {
  std::set<int32_t> seen;
  for (const RankLayout& r : ranks) {
    if (r.rank < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(group, ": negative rank ", r.rank));
    }
    if (!seen.insert(r.rank).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(group, ": rank ", r.rank, " is registered twice"));
    }
  }
  return absl::OkStatus();
}

// Checks that the distinct boxes of one parameter are pairwise disjoint and
// fill it. `shards` is sorted by box.
absl::Status CheckTiling(const ModelSpec& model, int32_t param,
                         const std::vector<RankLayout>& ranks,
                         const std::vector<SourceShard>& shards) {
  const ParamSpec& spec = model.params[param];
  const Box whole = FullBox(spec.shape);
  if (Volume(whole) == 0) return absl::OkStatus();
  if (shards.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("parameter '", spec.name, "': no source rank holds it"));
  }
  // A scalar has one box, the empty one: held means tiled. (The sweep below
  // needs a dimension to sweep along.)
  if (whole.rank() == 0) return absl::OkStatus();
  std::vector<const SourceShard*> order;
  order.reserve(shards.size());
  for (const SourceShard& s : shards) order.push_back(&s);
  const size_t d = SweepDim(order);
  std::sort(order.begin(), order.end(),
            [d](const SourceShard* a, const SourceShard* b) {
              return a->box.offset[d] < b->box.offset[d];
            });
  auto who = [&](const SourceShard* s) {
    return absl::StrCat("trainer rank ", ranks[s->holders[0].rank_index].rank,
                        " box ", BoxToString(s->box));
  };
  int64_t covered = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const Box& a = order[i]->box;
    const int64_t a_end = a.offset[d] + a.extent[d];
    for (size_t j = i + 1; j < order.size() && order[j]->box.offset[d] < a_end;
         ++j) {
      if (Overlaps(a, order[j]->box)) {
        return absl::InvalidArgumentError(absl::StrCat(
            "parameter '", spec.name, "': ", who(order[i]), " overlaps ",
            who(order[j]), " and they are not replicas (identical boxes)"));
      }
    }
    covered += Volume(a);
  }
  if (covered != Volume(whole)) {
    auto gap = FindGap(whole, shards);
    return absl::InvalidArgumentError(absl::StrCat(
        "parameter '", spec.name, "' shape ", DimsToString(spec.shape),
        ": source pieces cover ", covered, " of ", Volume(whole),
        " elements; box ", gap ? BoxToString(*gap) : "?",
        " is held by no trainer rank"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<SourceIndex> ValidateSources(
    const ModelSpec& model, const std::vector<RankLayout>& ranks) {
  absl::Status s = CheckDistinctRanks(ranks, "trainer");
  if (!s.ok()) return s;
  // Each step below runs per rank or per parameter on PlanningThreads()
  // threads; where several fail, the error is the one a pass in rank (or
  // parameter) order would have met first.
  const int threads = PlanningThreads();
  std::vector<absl::Status> by_rank(ranks.size());
  ParallelFor(ranks.size(), threads, [&](size_t r) {
    by_rank[r] = ValidateRankPieces(
        model, ranks[r], absl::StrCat("trainer rank ", ranks[r].rank),
        /*allow_staging=*/false);
  });
  s = FirstError(by_rank);
  if (!s.ok()) return s;
  // Every non-empty piece, grouped by parameter (a counting sort), then
  // each parameter's ordered by box and rank: shards and their holders.
  const size_t num_params = model.params.size();
  std::vector<size_t> start(num_params + 1, 0);
  for (const RankLayout& r : ranks) {
    for (const Piece& p : r.pieces) {
      if (Volume(p.box) != 0) ++start[p.param + 1];
    }
  }
  for (size_t p = 0; p < num_params; ++p) start[p + 1] += start[p];
  std::vector<PieceRef> refs(start[num_params]);
  {
    std::vector<size_t> at(start.begin(), start.end() - 1);
    for (size_t r = 0; r < ranks.size(); ++r) {
      const auto& pieces = ranks[r].pieces;
      for (size_t i = 0; i < pieces.size(); ++i) {
        if (Volume(pieces[i].box) == 0) continue;
        refs[at[pieces[i].param]++] =
            PieceRef{static_cast<int32_t>(r), static_cast<int32_t>(i)};
      }
    }
  }
  auto box_of = [&](const PieceRef& ref) -> const Box& {
    return ranks[ref.rank_index].pieces[ref.piece_index].box;
  };
  SourceIndex index;
  index.shards_by_param.resize(num_params);
  index.sweep_dim.assign(num_params, 0);
  index.max_sweep_extent.assign(num_params, 0);
  index.replicated.assign(num_params, 0);
  std::vector<absl::Status> by_param(num_params);
  ParallelFor(num_params, threads, [&](size_t p) {
    const auto first = refs.begin() + start[p];
    const auto last = refs.begin() + start[p + 1];
    std::sort(first, last, [&](const PieceRef& a, const PieceRef& b) {
      const Box& ba = box_of(a);
      const Box& bb = box_of(b);
      if (ba != bb) return ba < bb;
      return ranks[a.rank_index].rank < ranks[b.rank_index].rank;
    });
    auto& shards = index.shards_by_param[p];
    for (auto it = first; it != last; ++it) {
      const Box& box = box_of(*it);
      if (shards.empty() || shards.back().box != box) {
        shards.push_back(SourceShard{box, {}});
      } else if (ranks[shards.back().holders.back().rank_index].rank ==
                 ranks[it->rank_index].rank) {
        by_param[p] = absl::InvalidArgumentError(absl::StrCat(
            Where(model, static_cast<int32_t>(p),
                  absl::StrCat("trainer rank ", ranks[it->rank_index].rank),
                  box),
            ": the rank registers this box twice"));
        return;
      }
      shards.back().holders.push_back(*it);
    }
  });
  // A box registered twice is reported before any parameter's tiling.
  s = FirstError(by_param);
  if (!s.ok()) return s;
  ParallelFor(num_params, threads, [&](size_t p) {
    const std::vector<SourceShard>& shards = index.shards_by_param[p];
    by_param[p] = CheckTiling(model, static_cast<int32_t>(p), ranks, shards);
    if (!by_param[p].ok()) return;
    for (const SourceShard& sh : shards) {
      if (sh.holders.size() > 1) index.replicated[p] = 1;
    }
    if (shards.empty() || shards.front().box.rank() == 0) return;
    const size_t n = shards.front().box.rank();
    size_t d = 0;
    while (d < n && std::all_of(shards.begin(), shards.end(),
                                [&](const SourceShard& sh) {
                                  return sh.box.offset[d] ==
                                         shards.front().box.offset[d];
                                })) {
      ++d;
    }
    if (d == n) d = 0;
    index.sweep_dim[p] = static_cast<int32_t>(d);
    for (const SourceShard& sh : shards) {
      index.max_sweep_extent[p] =
          std::max(index.max_sweep_extent[p], sh.box.extent[d]);
    }
  });
  s = FirstError(by_param);
  if (!s.ok()) return s;
  return index;
}

std::pair<size_t, size_t> SourceIndex::ShardRange(int32_t param,
                                                  const Box& box) const {
  const std::vector<SourceShard>& shards = shards_by_param[param];
  if (shards.empty() || box.rank() == 0 || Volume(box) == 0 ||
      static_cast<size_t>(param) >= sweep_dim.size()) {
    return {0, shards.size()};
  }
  const size_t d = sweep_dim[param];
  const int64_t lo = box.offset[d];
  const int64_t hi = lo + box.extent[d];
  // A shard intersects only if offset < hi and offset + extent > lo, and
  // every extent is at most max_sweep_extent.
  auto at = [d](const SourceShard& sh, int64_t v) { return sh.box.offset[d] < v; };
  const auto first = std::lower_bound(shards.begin(), shards.end(),
                                      lo - max_sweep_extent[param] + 1, at);
  const auto last = std::lower_bound(first, shards.end(), hi, at);
  return {static_cast<size_t>(first - shards.begin()),
          static_cast<size_t>(last - shards.begin())};
}

namespace {

// Piece `p` in its buffer: a strided box of storage units.
StridedLayout MemoryLayout(const Piece& p, const ParamSpec& spec) {
  StridedLayout mem;
  mem.key = p.buffer;
  mem.offset = p.byte_offset;
  mem.extent = StorageShape(p.box.extent, spec.dtype);
  mem.stride = p.strides;
  mem.unit_bytes = UnitBytes(spec.dtype);
  return mem;
}

// Piece `p` among its parameter's own storage units laid out row-major:
// two pieces of one parameter claiming one element overlap there.
StridedLayout ParamLayout(const Piece& p, const ParamSpec& spec) {
  const Box units = StorageBox(p.box, spec.dtype);
  StridedLayout elems;
  elems.key = static_cast<uint64_t>(p.param);
  elems.stride = RowMajorStrides(StorageShape(spec.shape, spec.dtype));
  elems.extent = units.extent;
  for (size_t d = 0; d < units.rank(); ++d) {
    elems.offset += units.offset[d] * elems.stride[d];
  }
  return elems;
}

// Whether piece `p` passes SelfOverlapProblem by the common case, read off
// the piece without building its layout: going outward from the innermost
// dimension, each stride (of a dimension of extent > 1) at least the span
// of the dimensions inside it. The strides then grow outward, so this is
// the general test's order and its verdict; false means "ask the general
// test" (which also passes transposed and other reordered layouts).
bool NestedOutward(const Piece& p, int64_t block) {
  int64_t span = 1;
  for (size_t d = p.box.rank(); d-- > 0;) {
    const int64_t extent =
        d + 1 == p.box.rank() ? p.box.extent[d] / block : p.box.extent[d];
    if (extent <= 1) continue;
    const int64_t stride = p.strides[d];
    if (stride < span || stride == 0) return false;
    int64_t step;
    if (!CheckedMul(extent - 1, stride, &step) ||
        !CheckedAdd(span, step, &span)) {
      return false;
    }
  }
  return true;
}

// SpanOf(MemoryLayout(p)) and SpanOf(ParamLayout(p)) without building
// either layout; nullopt for an empty box. REQUIRES: ValidateRankPieces
// passed (the piece's end byte and the parameter's size fit in int64).
std::optional<LayoutSpan> MemorySpan(const Piece& p, const ParamSpec& spec,
                                     int32_t index) {
  const int64_t block = BlockElems(spec.dtype);
  int64_t last = 0;
  for (size_t d = 0; d < p.box.rank(); ++d) {
    const int64_t extent =
        d + 1 == p.box.rank() ? p.box.extent[d] / block : p.box.extent[d];
    if (extent == 0) return std::nullopt;
    last += (extent - 1) * p.strides[d];
  }
  return LayoutSpan{p.buffer, p.byte_offset,
                    p.byte_offset + (last + 1) * UnitBytes(spec.dtype), index};
}

std::optional<LayoutSpan> ParamSpan(const Piece& p, const ParamSpec& spec,
                                    int32_t index) {
  const int64_t block = BlockElems(spec.dtype);
  int64_t stride = 1, begin = 0, last = 0;
  for (size_t d = p.box.rank(); d-- > 0;) {
    const int64_t div = d + 1 == p.box.rank() ? block : 1;
    const int64_t extent = p.box.extent[d] / div;
    if (extent == 0) return std::nullopt;
    begin += p.box.offset[d] / div * stride;
    last += (extent - 1) * stride;
    stride *= spec.shape[d] / div;
  }
  return LayoutSpan{static_cast<uint64_t>(p.param), begin, begin + last + 1,
                    index};
}

}  // namespace

absl::Status ValidateDestinationRank(const ModelSpec& model,
                                    const RankLayout& rank,
                                    absl::string_view who,
                                    int64_t max_proof_runs) {
  // Every piece alone: no two of its elements on one byte (a zero stride
  // along a dimension of extent > 1 is the blunt case). Then the pieces
  // together, by their spans: a strided layout is built only for a piece
  // the common case does not clear, or whose span overlaps another's. A
  // destination rank of a Kimi-K2-sized model has ~140,000 pieces; two
  // layouts built per piece made this check half of planning's work.
  std::vector<LayoutSpan> in_memory;  // by buffer
  std::vector<LayoutSpan> in_param;   // by parameter, row-major
  in_memory.reserve(rank.pieces.size());
  in_param.reserve(rank.pieces.size());
  for (size_t i = 0; i < rank.pieces.size(); ++i) {
    const Piece& p = rank.pieces[i];
    const ParamSpec& spec = model.params[p.param];
    const int32_t index = static_cast<int32_t>(i);
    if (!NestedOutward(p, BlockElems(spec.dtype))) {
      const std::string problem = SelfOverlapProblem(MemoryLayout(p, spec));
      if (!problem.empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(Where(model, p.param, who, p.box), ": strides ",
                         DimsToString(p.strides), ": ", problem));
      }
    }
    if (std::optional<LayoutSpan> span = ParamSpan(p, spec, index)) {
      in_param.push_back(*span);
    }
    // Staging buffers hold one fallback tensor each; nothing shares them.
    if ((p.buffer & kStagingBufferBit) == 0) {
      if (std::optional<LayoutSpan> span = MemorySpan(p, spec, index)) {
        in_memory.push_back(*span);
      }
    }
  }
  auto layout_in = [&](bool memory) {
    return [&model, &rank, memory](int32_t i) {
      const Piece& p = rank.pieces[i];
      const ParamSpec& spec = model.params[p.param];
      return memory ? MemoryLayout(p, spec) : ParamLayout(p, spec);
    };
  };
  auto piece_at = [&](int32_t i) -> const Piece& { return rank.pieces[i]; };
  // One budget for both checks: it bounds the time one rank's proof takes.
  int64_t runs_left = max_proof_runs;
  OverlapResult same =
      FindOverlap(in_param, layout_in(/*memory=*/false), &runs_left);
  if (same.found()) {
    const Piece& a = piece_at(same.first);
    const Piece& b = piece_at(same.second);
    if (same.budget_exhausted) {
      return absl::ResourceExhaustedError(absl::StrCat(
          Where(model, a.param, who, a.box), " and box ", BoxToString(b.box),
          ": the rank's pieces of this parameter interleave too finely to "
          "prove in the rank's ", max_proof_runs, " runs that no element is "
          "claimed twice"));
    }
    return absl::InvalidArgumentError(
        absl::StrCat(Where(model, a.param, who, a.box), ": overlaps box ",
                     BoxToString(b.box), " of the same rank"));
  }
  OverlapResult bytes =
      FindOverlap(in_memory, layout_in(/*memory=*/true), &runs_left);
  if (bytes.found()) {
    const Piece& a = piece_at(bytes.first);
    const Piece& b = piece_at(bytes.second);
    if (bytes.budget_exhausted) {
      return absl::ResourceExhaustedError(absl::StrCat(
          Where(model, a.param, who, a.box), " and parameter '",
          model.params[b.param].name, "' box ", BoxToString(b.box),
          ": the rank's pieces in buffer ", a.buffer,
          " interleave too finely to prove in the rank's ", max_proof_runs,
          " runs that no byte is written twice"));
    }
    return absl::InvalidArgumentError(absl::StrCat(
        Where(model, a.param, who, a.box), " and parameter '",
        model.params[b.param].name, "' box ", BoxToString(b.box),
        " of the same rank both write byte ", bytes.at_byte, " of buffer ",
        a.buffer, "; a destination byte is written once (declare tied "
        "parameters with alias_of)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateDestination(const ModelSpec& model,
                                 const std::vector<RankLayout>& ranks,
                                 absl::string_view instance) {
  absl::Status s =
      CheckDistinctRanks(ranks, absl::StrCat("instance ", instance));
  if (!s.ok()) return s;
  // Ranks are checked side by side (each reads only its own pieces); the
  // error is the lowest rank's, as a rank-by-rank pass would return.
  std::vector<absl::Status> by_rank(ranks.size());
  ParallelFor(ranks.size(), PlanningThreads(), [&](size_t i) {
    const RankLayout& rank = ranks[i];
    const std::string who =
        absl::StrCat("instance ", instance, " rank ", rank.rank);
    absl::Status r = ValidateRankPieces(model, rank, who, /*allow_staging=*/true);
    if (r.ok()) {
      r = ValidateDestinationRank(model, rank, who,
                                  Limits::kMaxOverlapProofRuns);
    }
    by_rank[i] = std::move(r);
  });
  return FirstError(by_rank);
}

}  // namespace ferry
