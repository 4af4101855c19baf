#include "core/fp8_sources.h"

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/fp8_blocks.h"
#include "core/fp8_split.h"
#include "core/fp8_targets.h"
#include "core/region_copy.h"

namespace ferry {
namespace {

// (P, format, block rows, block cols): what one derived pair is.
using PairKey = std::tuple<int32_t, DType, int64_t, int64_t>;

// Bytes of each parameter the trainer ranks of each node hold (replicas
// count each time: a node with two replicas reads it locally twice over),
// for the parameters `wanted` marks, in one pass over the pieces.
std::vector<std::map<std::string, int64_t>> NodeBytes(
    const ModelSpec& model, const std::vector<RankLayout>& sources,
    const std::vector<bool>& wanted) {
  std::vector<std::map<std::string, int64_t>> out(model.params.size());
  for (const RankLayout& r : sources) {
    for (const Piece& p : r.pieces) {
      if (p.param < 0 || p.param >= static_cast<int32_t>(wanted.size()) ||
          !wanted[p.param]) {
        continue;
      }
      out[p.param][r.node] += BoxBytes(p.box, model.params[p.param].dtype);
    }
  }
  return out;
}

// Where a tensor is quantized: a node whose trainer ranks hold most of
// its bytes (`bytes`: NodeBytes' entry); among those (DP replicas hold
// the same bytes on different nodes), the one with the fewest bytes to
// quantize so far (`load`), so that replicas share the quantizing and the
// sending; then the lowest name. Deterministic for a given order of
// tensors. "" when no rank holds any.
std::string QuantizingNode(const std::map<std::string, int64_t>& bytes,
                           const std::map<std::string, int64_t>& load) {
  std::string best;
  int64_t most = -1, least = 0;
  for (const auto& [node, b] : bytes) {
    auto it = load.find(node);
    const int64_t l = it == load.end() ? 0 : it->second;
    if (b > most || (b == most && l < least)) {
      most = b;
      least = l;
      best = node;
    }
  }
  return best;
}

// Each wanted parameter's pieces in the trainer ranks, in rank order, in
// one pass.
std::vector<std::vector<HeldPiece>> PiecesOf(
    const std::vector<RankLayout>& sources, const std::vector<bool>& wanted) {
  std::vector<std::vector<HeldPiece>> out(wanted.size());
  for (size_t r = 0; r < sources.size(); ++r) {
    for (const Piece& p : sources[r].pieces) {
      if (p.param < 0 || p.param >= static_cast<int32_t>(wanted.size()) ||
          !wanted[p.param]) {
        continue;
      }
      out[p.param].push_back(HeldPiece{static_cast<int32_t>(r), &p});
    }
  }
  return out;
}

// The quantizer ranks, appended to the sources (one per node that
// quantizes, made at first need), and the checkpoint bytes each node
// quantizes so far.
class QuantizerRanks {
 public:
  explicit QuantizerRanks(std::vector<RankLayout>* sources)
      : sources_(sources) {}

  RankLayout& On(const std::string& node) {
    auto [it, fresh] =
        rank_of_.emplace(node, static_cast<int32_t>(sources_->size()));
    if (fresh) {
      RankLayout rank;
      rank.rank = it->second;
      rank.node = node;
      rank.buffer_bytes = {0, 0};
      sources_->push_back(std::move(rank));
    }
    return (*sources_)[it->second];
  }

  // Places q's derived tensors (`model` holds them; `c` is P): the scales
  // on q.node; the FP8 elements whole there, or each of `parts` on its
  // node.
  void Place(const ModelSpec& model, const ParamSpec& c,
             std::vector<QuantizedPart> parts, QuantizedParam* q) {
    RankLayout& home = On(q->node);
    q->source_rank = home.rank;
    const Box grid = FullBox(model.params[q->scale_param].shape);
    q->scale_offset = home.buffer_bytes[1];
    home.pieces.push_back(Piece::Contiguous(q->scale_param, grid, 1,
                                            q->scale_offset, DType::kF32));
    home.buffer_bytes[1] += BoxBytes(grid, DType::kF32);
    if (parts.empty()) {
      const Box full = FullBox(c.shape);
      q->fp8_offset = home.buffer_bytes[0];
      home.pieces.push_back(
          Piece::Contiguous(q->fp8_param, full, 0, q->fp8_offset, q->format));
      home.buffer_bytes[0] += BoxBytes(full, q->format);
      load[q->node] += BoxBytes(full, c.dtype);
    }
    for (QuantizedPart& part : parts) {
      RankLayout& rank = On(part.node);
      part.source_rank = rank.rank;
      part.fp8_offset = rank.buffer_bytes[0];
      rank.pieces.push_back(Piece::Contiguous(q->fp8_param, part.box, 0,
                                              part.fp8_offset, q->format));
      rank.buffer_bytes[0] += BoxBytes(part.box, q->format);
      load[part.node] += BoxBytes(part.box, c.dtype);
    }
    q->parts = std::move(parts);
  }

  std::map<std::string, int64_t> load;

 private:
  std::vector<RankLayout>* const sources_;
  std::map<std::string, int32_t> rank_of_;
};

// Instance `inst`'s targets as pieces of the derived parameters (in
// `model`), appended to its ranks (`ranks`): each target's box of the FP8 tensor and the
// scales of its blocks; a quantized fallback, the whole FP8 tensor or its
// scales in its staging buffer, row-major.
void AddTargetPieces(const ModelSpec& model, const ResolvedInstance& inst,
                     const std::vector<QuantizedParam>& quantized,
                     const std::map<PairKey, size_t>& pairs,
                     std::vector<RankLayout>* ranks) {
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    for (const QuantizedTarget& t : inst.ranks[r].quantized) {
      const QuantizedParam& q = quantized[pairs.at(
          PairKey{t.param, t.format, t.block_rows, t.block_cols})];
      Piece weight;
      weight.param = q.fp8_param;
      weight.buffer = t.weight_buffer;
      weight.byte_offset = t.weight_offset;
      weight.box = t.box;
      weight.strides = t.weight_strides;
      Piece scale;
      scale.param = q.scale_param;
      scale.buffer = t.scale_buffer;
      scale.byte_offset = t.scale_offset;
      scale.box = t.ScaleBox();
      scale.strides = t.scale_strides;
      (*ranks)[r].pieces.push_back(std::move(weight));
      (*ranks)[r].pieces.push_back(std::move(scale));
    }
    for (const FallbackTensor& f : inst.ranks[r].fallback) {
      if (!f.quantized()) continue;
      const QuantizedParam& q = quantized[pairs.at(
          PairKey{f.param, f.format, f.block_rows, f.block_cols})];
      const int32_t derived = f.scales ? q.scale_param : q.fp8_param;
      const ParamSpec& spec = model.params[derived];
      (*ranks)[r].pieces.push_back(Piece::Contiguous(
          derived, FullBox(spec.shape), f.staging_buffer, 0, spec.dtype));
    }
  }
}

}  // namespace

bool QuantizedParam::QuantizedOn(const std::string& at) const {
  if (!split()) return node == at;
  for (const QuantizedPart& p : parts) {
    if (p.node == at) return true;
  }
  return false;
}

bool ReceivesQuantized(const ResolvedInstance& r) {
  for (const ResolvedRank& rank : r.ranks) {
    if (!rank.quantized.empty()) return true;
    for (const FallbackTensor& f : rank.fallback) {
      if (f.quantized()) return true;
    }
  }
  return false;
}

absl::StatusOr<Fp8Sources> AddFp8Sources(
    const ModelSpec& model, const std::vector<RankLayout>& sources,
    const std::vector<const ResolvedInstance*>& resolved,
    std::vector<std::vector<RankLayout>>* layouts) {
  Fp8Sources out{model, sources, {}};
  // Every (P, format, block) some target needs, in that order: the ids
  // and offsets follow from it, the same on every daemon.
  std::map<PairKey, size_t> pairs;
  for (const ResolvedInstance* inst : resolved) {
    if (inst == nullptr) continue;
    for (const ResolvedRank& r : inst->ranks) {
      for (const QuantizedTarget& t : r.quantized) {
        if (t.param < 0 || t.param >= static_cast<int32_t>(model.params.size())) {
          return absl::InvalidArgumentError(absl::StrCat(
              "a quantized target names checkpoint parameter ", t.param,
              ", which the model does not have"));
        }
        pairs.emplace(PairKey{t.param, t.format, t.block_rows, t.block_cols},
                      0);
      }
      for (const FallbackTensor& f : r.fallback) {
        if (!f.quantized()) continue;
        pairs.emplace(PairKey{f.param, f.format, f.block_rows, f.block_cols},
                      0);
      }
    }
  }
  if (pairs.empty()) return out;
  std::vector<bool> wanted(model.params.size(), false);
  for (const auto& entry : pairs) wanted[std::get<0>(entry.first)] = true;
  const std::vector<std::map<std::string, int64_t>> node_bytes =
      NodeBytes(model, sources, wanted);
  const std::vector<std::vector<HeldPiece>> held = PiecesOf(sources, wanted);
  QuantizerRanks ranks(&out.sources);
  for (auto& [key, index] : pairs) {
    const auto [param, format, block_rows, block_cols] = key;
    const ParamSpec& c = model.params[param];
    if (c.shape.size() != 2) {
      return absl::UnimplementedError(absl::StrCat(
          "checkpoint parameter ", c.name, " of shape ",
          DimsToString(c.shape),
          " is quantized in flight, which takes 2-D tensors only"));
    }
    QuantizedParam q;
    q.param = param;
    q.format = format;
    q.block_rows = block_rows;
    q.block_cols = block_cols;
    q.node = QuantizingNode(node_bytes[param], ranks.load);
    if (q.node.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "checkpoint parameter ", c.name,
          " is quantized in flight, but no trainer rank holds it"));
    }
    absl::StatusOr<std::vector<QuantizedPart>> parts =
        ChooseParts(model, param, held[param], sources, node_bytes[param],
                    ranks.load, q.node);
    if (!parts.ok()) return parts.status();
    const std::string block = absl::StrCat(block_rows, "x", block_cols);
    q.fp8_param = static_cast<int32_t>(out.model.params.size());
    out.model.params.push_back(
        {absl::StrCat(c.name, "@", DTypeName(format), ":", block), format,
         c.shape});
    q.scale_param = static_cast<int32_t>(out.model.params.size());
    out.model.params.push_back({absl::StrCat(c.name, "@scale:", block),
                                DType::kF32,
                                Fp8ScaleShape(c.shape, block_rows, block_cols)});
    ranks.Place(out.model, c, *std::move(parts), &q);
    index = out.quantized.size();
    out.quantized.push_back(std::move(q));
  }
  out.model.BuildIndex();
  for (size_t i = 0; i < resolved.size(); ++i) {
    if (resolved[i] == nullptr) continue;
    AddTargetPieces(out.model, *resolved[i], out.quantized, pairs,
                    &(*layouts)[i]);
  }
  return out;
}

std::vector<std::vector<HeldPiece>> HeldPieces(
    const std::vector<QuantizedParam>& quantized,
    const std::vector<RankLayout>& sources) {
  std::map<int32_t, std::vector<size_t>> by_param;  // P -> its pairs
  for (size_t i = 0; i < quantized.size(); ++i) {
    by_param[quantized[i].param].push_back(i);
  }
  std::vector<std::vector<HeldPiece>> out(quantized.size());
  for (size_t r = 0; r < sources.size(); ++r) {
    for (const Piece& p : sources[r].pieces) {
      auto it = by_param.find(p.param);
      if (it == by_param.end()) continue;
      for (size_t i : it->second) {
        out[i].push_back(HeldPiece{static_cast<int32_t>(r), &p});
      }
    }
  }
  return out;
}

const uint8_t* BaseOf(const HeldPiece& h,
                      const std::vector<std::vector<const uint8_t*>>& bases) {
  const size_t r = static_cast<size_t>(h.rank);
  if (r >= bases.size() || h.piece->buffer >= bases[r].size()) return nullptr;
  return bases[r][h.piece->buffer];
}

namespace {

// The first element of `q`'s tensor that no piece `counts` covers, as a
// flat index, or -1.
int64_t FirstHole(const ModelSpec& model, const QuantizedParam& q,
                  const std::vector<HeldPiece>& held,
                  const std::function<bool(const HeldPiece&)>& counts) {
  const Dims& shape = model.params[q.param].shape;
  // The usual case, in the pieces' number rather than the elements': the
  // distinct boxes that count (replicas hold the same box) are pairwise
  // disjoint and their elements add up to the tensor's, so they tile it.
  // Anything else (a hole, or boxes that overlap in part) is left to the
  // map of elements below, which also finds the first hole.
  std::vector<const Box*> boxes;
  for (const HeldPiece& h : held) {
    if (!counts(h)) continue;
    const Box* b = &h.piece->box;
    if (std::none_of(boxes.begin(), boxes.end(),
                     [&](const Box* o) { return *o == *b; })) {
      boxes.push_back(b);
    }
  }
  int64_t elements = 0;
  bool disjoint = true;
  for (size_t i = 0; i < boxes.size() && disjoint; ++i) {
    elements += boxes[i]->extent[0] * boxes[i]->extent[1];
    for (size_t j = 0; j < i && disjoint; ++j) {
      disjoint = !Overlaps(*boxes[i], *boxes[j]);
    }
  }
  if (disjoint && elements == shape[0] * shape[1]) return -1;
  // A byte per element, set a box row at a time.
  std::vector<uint8_t> covered(static_cast<size_t>(shape[0] * shape[1]), 0);
  for (const HeldPiece& h : held) {
    if (!counts(h)) continue;
    const Box& box = h.piece->box;
    for (int64_t i = 0; i < box.extent[0]; ++i) {
      std::memset(&covered[(box.offset[0] + i) * shape[1] + box.offset[1]], 1,
                  static_cast<size_t>(box.extent[1]));
    }
  }
  const void* hole = std::memchr(covered.data(), 0, covered.size());
  return hole == nullptr ? -1 : static_cast<const uint8_t*>(hole) - covered.data();
}

}  // namespace

absl::Status CheckReadable(const ModelSpec& model, const QuantizedParam& q,
                           const std::vector<HeldPiece>& held,
                           const std::vector<std::vector<const uint8_t*>>& bases) {
  return CheckReadable(model, q, held, [&](const HeldPiece& h) {
    return BaseOf(h, bases) != nullptr;
  });
}

absl::Status CheckReadable(
    const ModelSpec& model, const QuantizedParam& q,
    const std::vector<HeldPiece>& held,
    const std::function<bool(const HeldPiece&)>& readable) {
  const int64_t k = FirstHole(model, q, held, readable);
  if (k < 0) return absl::OkStatus();
  const ParamSpec& c = model.params[q.param];
  return absl::FailedPreconditionError(absl::StrCat(
      "quantizing ", c.name, " on ", q.node, ": element [", k / c.shape[1],
      ", ", k % c.shape[1],
      "] is on no trainer rank readable there (its rank is on another node, "
      "or in GPU memory where this ferryd has no GPUs)"));
}

absl::Status QuantizeParam(const ModelSpec& model, const QuantizedParam& q,
                           const std::vector<HeldPiece>& held,
                           const std::vector<std::vector<const uint8_t*>>& bases,
                           uint8_t* fp8_buffer, uint8_t* scale_buffer) {
  const ParamSpec& c = model.params[q.param];
  if (q.split()) {
    return absl::InternalError(absl::StrCat(
        c.name, " is split over nodes: QuantizeParts quantizes it"));
  }
  const Dims& shape = c.shape;
  const Fp8BlockShape blocks{shape[0], shape[1], q.block_rows, q.block_cols};
  float* scales = reinterpret_cast<float*>(scale_buffer + q.scale_offset);
  const Box full = FullBox(shape);
  const Dims row_major = RowMajorStrides(shape);
  // A rank that holds P whole and row-major: quantized where it is.
  for (const HeldPiece& h : held) {
    const uint8_t* base = BaseOf(h, bases);
    if (base != nullptr && h.piece->box == full &&
        h.piece->strides == row_major) {
      return QuantizeBlocks(base + h.piece->byte_offset, c.dtype, blocks,
                            q.format, fp8_buffer + q.fp8_offset, scales);
    }
  }
  // Else P assembled, whole and row-major.
  std::vector<uint8_t> whole(BoxBytes(full, c.dtype));
  const Piece target = Piece::Contiguous(q.param, full, 0, 0, c.dtype);
  for (const HeldPiece& h : held) {
    const uint8_t* base = BaseOf(h, bases);
    if (base != nullptr) {
      CopyBoxBetweenPieces(base, *h.piece, whole.data(), target, h.piece->box,
                           c.dtype);
    }
  }
  return QuantizeBlocks(whole.data(), c.dtype, blocks, q.format,
                        fp8_buffer + q.fp8_offset, scales);
}

}  // namespace ferry
