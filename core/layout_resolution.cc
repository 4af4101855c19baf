#include "core/layout_resolution.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/strings/string_view.h"
#include "core/checked_math.h"
#include "core/fp8_targets.h"
#include "core/parallel_for.h"

namespace ferry {

const std::vector<FusedPart>& FusedParts::Empty() {
  static const std::vector<FusedPart>* const empty =
      new std::vector<FusedPart>();
  return *empty;
}

bool EngineParam::operator==(const EngineParam& o) const {
  return name == o.name && dtype == o.dtype && local_shape == o.local_shape &&
         buffer == o.buffer && byte_offset == o.byte_offset &&
         loader == o.loader && tp_size == o.tp_size &&
         shard_dim == o.shard_dim && flags == o.flags && parts == o.parts &&
         consumes == o.consumes && alias_of == o.alias_of && fp8 == o.fp8;
}


const char* ResolutionName(Resolution r) {
  switch (r) {
    case Resolution::kDirect:
      return "direct";
    case Resolution::kFused:
      return "fused";
    case Resolution::kFallback:
      return "fallback";
    case Resolution::kQuantized:
      return "quantized";
  }
  return "unknown";
}

namespace {

// vLLM pads the vocabulary to a multiple of 64 rows
// (DEFAULT_VOCAB_PADDING_SIZE) and splits the padded rows evenly, so all the
// padding sits at the end. Padding of a whole shard and of 64 rows or more
// cannot come from that rule: the table describes something else (say, a
// replicated embedding mislabelled as vocab-parallel), so it falls back.
// Tiny vocabularies may leave whole ranks in padding; they hold no piece.
constexpr int64_t kVocabPadRows = 64;

constexpr uint32_t kKnownFlags = kFlagPacked | kFlagTransposed |
                                 kFlagPreSharded | kFlagWrappedLoader |
                                 kFlagTransformed;

using NameIndex = absl::flat_hash_map<absl::string_view, int32_t>;

// Everything a per-parameter decision needs to know about its rank.
struct RankContext {
  const ModelSpec& model;
  int32_t tp_size;
  int32_t tp_rank;
};

// A set of checkpoint parameter ids, emptied in O(1): a stamp per id
// instead of a hash set, because sets of ids are built per engine parameter
// per rank and a MoE w13 names hundreds of them.
class IdSet {
 public:
  explicit IdSet(size_t ids) : stamp_(ids, 0) {}

  void Clear() {
    if (++epoch_ == 0) {  // wrapped: stale stamps would count as members
      std::fill(stamp_.begin(), stamp_.end(), 0);
      epoch_ = 1;
    }
  }
  // Adds `id` (a valid checkpoint id); false when it was in already.
  bool Insert(int32_t id) {
    if (stamp_[id] == epoch_) return false;
    stamp_[id] = epoch_;
    return true;
  }

 private:
  std::vector<uint32_t> stamp_;
  uint32_t epoch_ = 1;
};

// The model's names, built once per resolution and read by every worker.
struct ModelNames {
  explicit ModelNames(const ModelSpec& m) {
    // Our own index: the caller's ModelSpec may not have called BuildIndex.
    // A duplicated name means its first parameter, as in ModelSpec::Find.
    names.reserve(m.params.size());
    for (size_t i = 0; i < m.params.size(); ++i) {
      names.emplace(m.params[i].name, static_cast<int32_t>(i));
    }
    unique = names.size() == m.params.size();
  }
  NameIndex names;
  bool unique = true;
};

// What one worker resolving ranks holds: the model, its shared name index,
// and what the worker already learnt about the checkpoint parameters.
struct ModelIndex {
  ModelIndex(const ModelSpec& m, const ModelNames& n)
      : model(m),
        names(n.names),
        unique_names(n.unique),
        validated(m.params.size(), false),
        scratch(m.params.size()) {}

  int32_t Find(absl::string_view name) const {
    auto it = names.find(name);
    return it == names.end() ? -1 : it->second;
  }

  // Find(name), trying `guess` first. One string compare where a lookup
  // costs two cache misses; only when no name repeats, as then the
  // parameter with the name is the one the index holds.
  int32_t FindNear(absl::string_view name, int64_t guess) const {
    if (unique_names && guess >= 0 &&
        guess < static_cast<int64_t>(model.params.size()) &&
        model.params[guess].name == name) {
      return static_cast<int32_t>(guess);
    }
    return Find(name);
  }

  const ModelSpec& model;
  const NameIndex& names;
  const bool unique_names;
  // Checkpoint parameters that passed ValidateCheckpointParam: every rank
  // refers to the same ones, and a failure is an error that ends it all.
  std::vector<bool> validated;
  IdSet scratch;  // for Unique and other one-parameter id sets
};

// The checkpoint parameters one engine parameter refers to, validated.
struct ParamRefs {
  int32_t plain = -1;           // non-fused loaders: the one it copies, or -1
  std::vector<int32_t> parts;   // kFused: one per FusedPart, in order
  std::vector<int32_t> whole;   // what the rank receives if it falls back
};

// A position in a live tensor. Four inline: a fused MoE tensor is 3-D
// ({expert, rows, columns}), and one placement is made per expert per
// rank, so Dims (two inline) would allocate for each.
using LocalDims = absl::InlinedVector<int64_t, 4>;

// One box of a checkpoint parameter at one position of the live tensor.
struct Placement {
  int32_t param;
  Box box;                 // in the checkpoint tensor, elements
  LocalDims local_offset;  // in the live tensor (lead dims included), elements
};

// A decision before the module rule and before pieces are built.
struct Outcome {
  Resolution resolution = Resolution::kFallback;
  std::string reason;
  std::vector<Placement> placements;
  // kQuantized: the whole tensor quantized, through the engine's loader
  // (a quantized fallback), not placed.
  bool through_loader = false;
};

Outcome Fallback(absl::string_view why) {
  Outcome out;
  out.resolution = Resolution::kFallback;
  out.reason = absl::StrCat("fallback: ", why);
  return out;
}

absl::Status ParamError(const EngineParam& p, int32_t rank,
                        absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "engine parameter '", p.name, "' on rank ", rank, ": ", what));
}

// "rows" for dim 0, "columns" for dim 1: how people talk about weights.
std::string RangeWord(int64_t dim) {
  if (dim == 0) return "rows";
  if (dim == 1) return "columns";
  return absl::StrCat("dim ", dim, " indices");
}

// "q_proj.weight" for a part of "model.layers.0.self_attn.qkv_proj.weight":
// the part's name past the dotted prefix it shares with the engine name.
absl::string_view ShortPartName(absl::string_view engine,
                                absl::string_view part) {
  size_t cut = 0;
  for (size_t i = 0; i < std::min(engine.size(), part.size()); ++i) {
    if (engine[i] != part[i]) break;
    if (part[i] == '.') cut = i + 1;
  }
  return part.substr(cut);
}

// The module that owns an engine parameter: its name up to the last '.'
// (the root module, "", for a name without one, as in vLLM).
absl::string_view ModuleOf(absl::string_view name) {
  const size_t dot = name.rfind('.');
  return dot == absl::string_view::npos ? absl::string_view()
                                        : name.substr(0, dot);
}

// ---------------------------------------------------------------------------
// Validation: the things that are errors, not fallbacks.

// Checks the table set and returns the tables ordered by TP rank.
absl::StatusOr<std::vector<const EngineTableView*>> OrderTables(
    const std::vector<EngineTableView>& tables) {
  if (tables.empty()) {
    return absl::InvalidArgumentError("no engine tables: an instance has at "
                                      "least one rank");
  }
  const int32_t tp_size = tables[0].tp_size;
  for (const EngineTableView& t : tables) {
    if (t.tp_size != tp_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", t.tp_rank, " says tp_size ", t.tp_size, " but rank ",
          tables[0].tp_rank, " says tp_size ", tp_size));
    }
  }
  if (tp_size < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp_size ", tp_size, " on rank ", tables[0].tp_rank,
                     " is not positive"));
  }
  // Nothing is sized by tp_size, a number from the tables, until every rank
  // below it is known to have a table: one table claiming tp_size 2^31 - 1
  // is an error, not a 16 GiB vector.
  absl::flat_hash_set<int32_t> ranks;
  for (const EngineTableView& t : tables) {
    if (t.tp_rank < 0 || t.tp_rank >= tp_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rank ", t.tp_rank, " is outside [0, ", tp_size, ")"));
    }
    if (!ranks.insert(t.tp_rank).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("duplicate table for rank ", t.tp_rank));
    }
  }
  for (int32_t r = 0; r < tp_size; ++r) {
    if (!ranks.contains(r)) {  // found within tables.size() + 1 steps
      return absl::InvalidArgumentError(
          absl::StrCat("missing table for rank ", r, " (tp_size ", tp_size,
                       ", ", tables.size(), " tables)"));
    }
  }
  std::vector<const EngineTableView*> by_rank(tp_size, nullptr);
  for (const EngineTableView& t : tables) by_rank[t.tp_rank] = &t;
  return by_rank;
}

// Bytes of a contiguous tensor. A block-quantized last dim that is not whole
// blocks (such a tensor always falls back) is counted rounded up.
bool TensorBytes(const Dims& shape, DType dtype, int64_t* bytes) {
  const int64_t block = BlockElems(dtype);
  int64_t units = 1;
  for (size_t i = 0; i < shape.size(); ++i) {
    const int64_t d = i + 1 == shape.size()
                          ? shape[i] / block + (shape[i] % block != 0)
                          : shape[i];
    if (!CheckedMul(units, d, &units)) return false;
  }
  return CheckedMul(units, UnitBytes(dtype), bytes);
}

// A checkpoint parameter an engine parameter refers to must be well formed:
// a real dtype, a shape whose byte size fits, whole blocks.
absl::Status ValidateCheckpointParam(const ParamSpec& c, const EngineParam& p,
                                     int32_t rank) {
  if (!IsValidDType(c.dtype)) {
    return ParamError(p, rank,
                      absl::StrCat("checkpoint parameter '", c.name,
                                   "' has no valid dtype"));
  }
  absl::Status s = ValidateShape(c.shape);
  int64_t bytes;
  if (s.ok() && !TensorBytes(c.shape, c.dtype, &bytes)) {
    s = absl::InvalidArgumentError(
        absl::StrCat("shape ", DimsToString(c.shape), " is too large"));
  }
  if (s.ok() && IsBlockQuantized(c.dtype) &&
      (c.shape.empty() || c.shape.back() % BlockElems(c.dtype) != 0)) {
    s = absl::InvalidArgumentError(absl::StrCat(
        "shape ", DimsToString(c.shape), " is not whole ",
        DTypeName(c.dtype), " blocks of ", BlockElems(c.dtype),
        " elements in its last dim"));
  }
  if (!s.ok()) {
    return ParamError(p, rank,
                      absl::StrCat("checkpoint parameter '", c.name, "': ",
                                   s.message()));
  }
  return absl::OkStatus();
}

// The live tensor itself: dtype, shape, and its place in its buffer.
absl::Status ValidateLiveTensor(const EngineParam& p,
                                const EngineTableView& t) {
  const int32_t rank = t.tp_rank;
  if (!IsValidDType(p.dtype)) return ParamError(p, rank, "no valid dtype");
  absl::Status s = ValidateShape(p.local_shape);
  if (!s.ok()) return ParamError(p, rank, s.message());
  if (IsBlockQuantized(p.dtype) && p.local_shape.empty()) {
    return ParamError(p, rank, "a block-quantized scalar has no storage");
  }
  if (p.byte_offset < 0) {
    return ParamError(p, rank, absl::StrCat("negative byte offset ",
                                            p.byte_offset));
  }
  int64_t bytes, end;
  if (!TensorBytes(p.local_shape, p.dtype, &bytes) ||
      !CheckedAdd(p.byte_offset, bytes, &end)) {
    return ParamError(p, rank,
                      absl::StrCat("local shape ",
                                   DimsToString(p.local_shape), " at byte ",
                                   p.byte_offset, " overflows 64 bits"));
  }
  if (t.buffer_bytes.empty()) return absl::OkStatus();
  if (p.buffer >= t.buffer_bytes.size()) {
    return ParamError(p, rank,
                      absl::StrCat("buffer ", p.buffer,
                                   " is not registered (the rank has ",
                                   t.buffer_bytes.size(), " buffers)"));
  }
  if (end > t.buffer_bytes[p.buffer]) {
    return ParamError(
        p, rank,
        absl::StrCat("local shape ", DimsToString(p.local_shape), " ",
                     DTypeName(p.dtype), " at bytes [", p.byte_offset, ", ",
                     end, ") runs past the end of buffer ", p.buffer, " (",
                     t.buffer_bytes[p.buffer], " bytes)"));
  }
  return absl::OkStatus();
}

// `ids` without repeats, in first-seen order. Marked, not scanned: a MoE w13
// of a large model has hundreds of parts.
std::vector<int32_t> Unique(const std::vector<int32_t>& ids, IdSet* seen) {
  seen->Clear();
  std::vector<int32_t> out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    if (seen->Insert(id)) out.push_back(id);
  }
  return out;
}

// Looks up every checkpoint name the parameter mentions. A name the model
// does not have is an error: the table and the model disagree, and no
// fallback could feed the loader either.
absl::StatusOr<ParamRefs> ResolveNames(ModelIndex* mi, const EngineParam& p,
                                       int32_t rank) {
  auto find = [&](const std::string& name) { return mi->Find(name); };
  ParamRefs refs;
  refs.parts.reserve(p.parts.size());
  for (const FusedPart& part : p.parts) {
    // A MoE tensor's parts follow the checkpoint at a steady stride, or two
    // alternating ones (gate_e, up_e, gate_e+1, ...): either way part k is
    // where part k - 2 was plus the step from part k - 4 to part k - 2.
    const std::vector<int32_t>& ids = refs.parts;
    const size_t k = ids.size();
    const int64_t guess = k >= 4 ? 2 * int64_t{ids[k - 2]} - ids[k - 4] : -1;
    const int32_t id = mi->FindNear(part.checkpoint_name, guess);
    if (id < 0) {
      return ParamError(p, rank,
                        absl::StrCat("fused part '", part.checkpoint_name,
                                     "' is not a checkpoint parameter"));
    }
    if (part.local_extent < 0) {
      return ParamError(p, rank,
                        absl::StrCat("fused part '", part.checkpoint_name,
                                     "' has negative local extent ",
                                     part.local_extent));
    }
    refs.parts.push_back(id);
  }
  std::vector<int32_t> consumed;
  consumed.reserve(p.consumes.size());
  for (const std::string& name : p.consumes) {
    const int32_t id = find(name);
    if (id < 0) {
      return ParamError(p, rank, absl::StrCat("consumes '", name,
                                              "', which is not a checkpoint "
                                              "parameter"));
    }
    consumed.push_back(id);
  }
  consumed = Unique(consumed, &mi->scratch);
  const bool fused = p.loader == LoaderKind::kFused && !p.parts.empty();
  if (!fused && p.consumes.empty()) {
    refs.plain = find(p.name);
    if (refs.plain < 0) {
      return ParamError(p, rank,
                        "consumes nothing the checkpoint has: no checkpoint "
                        "parameter has its name and it lists no consumes");
    }
  } else if (!fused && consumed.size() == 1) {
    refs.plain = consumed[0];
  }
  if (fused) {
    refs.whole = Unique(refs.parts, &mi->scratch);
  } else if (!consumed.empty()) {
    refs.whole = std::move(consumed);
  } else {
    refs.whole = {refs.plain};
  }
  // Parts place boxes only for a fused loader (their names were checked
  // anyway: the table should not name what the model lacks).
  if (!fused) refs.parts.clear();
  for (int32_t id : refs.whole) {
    if (mi->validated[id]) continue;
    absl::Status s = ValidateCheckpointParam(mi->model.params[id], p, rank);
    if (!s.ok()) return s;
    mi->validated[id] = true;
  }
  return refs;
}

// Whether ResolveNames would give `p` exactly what it gave `q`: the same
// names in the same roles (and the same part extents, whose sign it
// checks). Ranks of an instance usually list the same
// parameters in the same order, so comparing with rank 0's entry is cheaper
// than hashing every name again; anything that differs (EP ranks hold other
// experts) is looked up afresh.
bool SameNames(const EngineParam& p, const EngineParam& q) {
  if (p.name != q.name || p.loader != q.loader ||
      p.parts.size() != q.parts.size() || p.consumes != q.consumes ||
      p.alias_of != q.alias_of) {
    return false;
  }
  // Shared parts (the usual case: see FusedParts) are equal parts.
  if (p.parts.SharesWith(q.parts)) return true;
  for (size_t i = 0; i < p.parts.size(); ++i) {
    if (p.parts[i].local_extent != q.parts[i].local_extent ||
        p.parts[i].checkpoint_name != q.parts[i].checkpoint_name) {
      return false;
    }
  }
  return true;
}

// ---------------------------------------------------------------------------
// Decisions: one function per loader kind. Each either places boxes of the
// checkpoint into the live tensor or explains why it cannot.

// Reasons that hold whatever the loader kind: ferry cannot reproduce what
// the engine does between reading the checkpoint and storing the tensor.
std::string FlagReason(uint32_t flags) {
  if (flags & kFlagPacked) return "packed storage";
  if (flags & kFlagTransposed) return "transposed storage";
  if (flags & kFlagPreSharded) return "checkpoint is pre-sharded";
  if (flags & kFlagWrappedLoader) return "loader is wrapped";
  if (flags & kFlagTransformed) return "load_weights transforms it";
  return absl::StrCat("unknown flags 0x", absl::Hex(flags & ~kKnownFlags));
}

std::string DTypeMismatch(DType engine, DType checkpoint) {
  return absl::StrCat("engine dtype ", DTypeName(engine), " != checkpoint ",
                      DTypeName(checkpoint), " (loader converts)");
}

// The whole tensor on every rank (norms, ReplicatedLinear).
Outcome ResolveReplicated(const EngineParam& p, int32_t id,
                          const ParamSpec& c) {
  if (p.local_shape != c.shape) {
    return Fallback(absl::StrCat("local shape ", DimsToString(p.local_shape),
                                 " does not match checkpoint ",
                                 DimsToString(c.shape),
                                 " for a replicated loader"));
  }
  Outcome out;
  out.resolution = Resolution::kDirect;
  out.reason = absl::StrCat("replicated (whole ", DimsToString(c.shape), ")");
  out.placements.push_back(
      {id, FullBox(c.shape), LocalDims(c.shape.size(), 0)});
  return out;
}

// An even split along one dim (ColumnParallelLinear: output dim,
// RowParallelLinear: input dim). vLLM narrows rank r's slice
// [r * local, (r + 1) * local) and copies it; the shapes must say exactly
// that, or the loader does something else.
Outcome ResolveEvenSplit(const RankContext& ctx, const EngineParam& p,
                         int32_t id, const ParamSpec& c) {
  const Dims& local = p.local_shape;
  const int64_t d = p.shard_dim;
  if (local.size() != c.shape.size()) {
    return Fallback(absl::StrCat("local shape ", DimsToString(local),
                                 " and checkpoint ", DimsToString(c.shape),
                                 " differ in rank"));
  }
  if (d < 0 || d >= static_cast<int64_t>(c.shape.size())) {
    return Fallback(absl::StrCat("shard dim ", d, " is not a dim of checkpoint ",
                                 DimsToString(c.shape)));
  }
  for (size_t j = 0; j < local.size(); ++j) {
    int64_t expect = local[j];
    if (static_cast<int64_t>(j) == d &&
        !CheckedMul(local[j], ctx.tp_size, &expect)) {
      expect = -1;
    }
    if (expect != c.shape[j]) {
      return Fallback(absl::StrCat(
          "local shape ", DimsToString(local), " x tp ", ctx.tp_size,
          " does not match checkpoint ", DimsToString(c.shape), " in dim ", j));
    }
  }
  Placement pl{id, FullBox(c.shape), LocalDims(local.size(), 0)};
  pl.box.offset[d] = ctx.tp_rank * local[d];
  pl.box.extent[d] = local[d];
  Outcome out;
  out.resolution = Resolution::kDirect;
  out.reason = absl::StrCat(
      p.loader == LoaderKind::kColumn ? "column" : "row", " shard of dim ", d,
      " (", RangeWord(d), " ", pl.box.offset[d], ":",
      pl.box.offset[d] + local[d], ")");
  out.placements.push_back(std::move(pl));
  return out;
}

// VocabParallelEmbedding / ParallelLMHead: dim 0 padded to local * tp rows
// and split evenly; rank r holds [r * local, min((r + 1) * local, vocab)).
// Its padding rows are zeroed by the engine once and never written here; a
// rank entirely in padding holds no piece at all.
Outcome ResolveVocabParallel(const RankContext& ctx, const EngineParam& p,
                             int32_t id, const ParamSpec& c) {
  const Dims& local = p.local_shape;
  if (local.empty() || local.size() != c.shape.size()) {
    return Fallback(absl::StrCat("local shape ", DimsToString(local),
                                 " cannot be a vocab shard of checkpoint ",
                                 DimsToString(c.shape)));
  }
  for (size_t j = 1; j < local.size(); ++j) {
    if (local[j] != c.shape[j]) {
      return Fallback(absl::StrCat("local shape ", DimsToString(local),
                                   " does not match checkpoint ",
                                   DimsToString(c.shape), " in dim ", j));
    }
  }
  const int64_t vocab = c.shape[0];
  int64_t padded;
  if (!CheckedMul(local[0], ctx.tp_size, &padded) || padded < vocab) {
    return Fallback(absl::StrCat("local shape ", DimsToString(local), " x tp ",
                                 ctx.tp_size, " does not cover checkpoint ",
                                 DimsToString(c.shape), " in dim 0"));
  }
  if (padded - vocab >= std::max(local[0], kVocabPadRows)) {
    return Fallback(absl::StrCat(
        "local shape ", DimsToString(local), " x tp ", ctx.tp_size, " holds ",
        padded, " rows for ", vocab,
        ": more padding than one shard or 64 rows"));
  }
  const int64_t lo = std::min(ctx.tp_rank * local[0], vocab);
  const int64_t hi = std::min(lo + local[0], vocab);
  const int64_t pad = local[0] - (hi - lo);
  Outcome out;
  out.resolution = Resolution::kDirect;
  if (hi == lo) {
    out.reason = absl::StrCat("vocab shard of dim 0 (all ", local[0],
                              " rows padding)");
    return out;
  }
  out.reason = absl::StrCat("vocab shard of dim 0 (rows ", lo, ":", hi,
                            pad > 0 ? absl::StrCat(", ", pad, " padding rows")
                                    : "",
                            ")");
  Placement pl{id, FullBox(c.shape), LocalDims(local.size(), 0)};
  pl.box.offset[0] = lo;
  pl.box.extent[0] = hi - lo;
  out.placements.push_back(std::move(pl));
  return out;
}

// Where rank r's rows of one fused part come from: either an even split
// (extent * tp == rows) or replication over groups of ranks (GQA kv heads
// when tp > kv heads: vLLM's shard id is rank / replicas).
struct PartShard {
  int64_t start = 0;   // first checkpoint row this rank holds
  int64_t extent = 0;  // rows it holds
  int64_t replicas = 1;
  std::string error;   // non-empty: why the part cannot be placed
};

PartShard ShardPart(const FusedPart& part, int64_t rows, int32_t tp_size,
                    int32_t tp_rank) {
  PartShard s;
  const absl::string_view name = part.checkpoint_name;
  if (part.local_extent == 0 && rows % tp_size != 0) {
    s.error = absl::StrCat("part ", name, " has ", rows,
                           " rows, which do not split evenly over tp ",
                           tp_size);
    return s;
  }
  s.extent = part.local_extent > 0 ? part.local_extent : rows / tp_size;
  int64_t cover;
  if (!CheckedMul(s.extent, tp_size, &cover) || cover < rows) {
    s.error = absl::StrCat("part ", name, ": ", s.extent,
                           " local rows x tp ", tp_size,
                           " do not cover its ", rows, " rows");
    return s;
  }
  if (cover == rows) {
    s.start = tp_rank * s.extent;
    return s;
  }
  if (rows == 0 || rows % s.extent != 0 || cover % rows != 0) {
    s.error = absl::StrCat("part ", name, ": ", s.extent,
                           " local rows x tp ", tp_size,
                           " do not replicate its ", rows,
                           " rows over whole groups of ranks");
    return s;
  }
  s.replicas = cover / rows;
  s.start = (tp_rank / s.replicas) * s.extent;
  return s;
}

// The lead indices of a fused tensor's parts, numbered in first-seen order
// so that reasons do not depend on hash order, with the rows placed so far
// at each. When the tensor has no more lead slots than parts (a MoE w13:
// one slot per expert, two parts each) a slot is found by its row-major
// position in a table, not by hashing its index.
class LeadSlots {
 public:
  // `slots`: how many lead slots `local` has, -1 when that overflows.
  LeadSlots(const Dims& local, size_t lead, int64_t slots, size_t parts)
      : local_(local), lead_(lead) {
    if (slots >= 0 && slots <= static_cast<int64_t>(parts)) {
      dense_.assign(slots, -1);
      indices_.reserve(slots);
      rows_.reserve(slots);
    } else {
      hashed_ = true;
    }
  }

  // The rows placed so far at `index` (inside the lead dims of the local
  // shape), a new slot holding 0 rows the first time it is seen.
  int64_t& RowsAt(const Dims& index) {
    size_t slot;
    if (hashed_) {
      auto [it, added] = slot_of_.emplace(index, indices_.size());
      if (added) Add(index);
      slot = it->second;
    } else {
      int64_t flat = 0;  // < slots: each index[k] < local[k]
      for (size_t k = 0; k < lead_; ++k) flat = flat * local_[k] + index[k];
      int32_t& s = dense_[flat];
      if (s < 0) {
        s = static_cast<int32_t>(indices_.size());
        Add(index);
      }
      slot = s;
    }
    return rows_[slot];
  }

  size_t size() const { return indices_.size(); }
  const Dims& index(size_t slot) const { return indices_[slot]; }
  int64_t rows(size_t slot) const { return rows_[slot]; }

 private:
  void Add(const Dims& index) {
    indices_.push_back(index);
    rows_.push_back(0);
  }

  const Dims& local_;
  const size_t lead_;
  bool hashed_ = false;
  std::vector<int32_t> dense_;                 // by row-major position
  absl::flat_hash_map<Dims, size_t> slot_of_;  // when hashed_
  std::vector<Dims> indices_;                  // by slot
  std::vector<int64_t> rows_;                  // by slot
};

// QKVParallelLinear, MergedColumnParallelLinear, FusedMoE w13/w2: the live
// tensor is [lead dims..., checkpoint dims...] and, within each lead index,
// the parts' shards are concatenated along shard_dim in declared order.
// `same_dtype`: the parts must have the live tensor's dtype (false for an
// FP8 weight, whose parts' dtypes DecideQuantized checks).
Outcome ResolveFused(const RankContext& ctx, const EngineParam& p,
                     const std::vector<int32_t>& part_ids,
                     bool same_dtype = true) {
  if (part_ids.empty()) return Fallback("fused loader declares no parts");
  const Dims& local = p.local_shape;
  const size_t rank = ctx.model.params[part_ids[0]].shape.size();
  if (local.size() < rank) {
    return Fallback(absl::StrCat("local shape ", DimsToString(local),
                                 " has fewer dims than its parts (", rank,
                                 ")"));
  }
  const size_t lead = local.size() - rank;
  const int64_t d = p.shard_dim;
  if (d < 0 || d >= static_cast<int64_t>(rank)) {
    return Fallback(absl::StrCat("shard dim ", d,
                                 " is not a dim of the fused parts"));
  }
  const size_t ld = lead + d;  // the shard dim in the live tensor
  // Every lead slot must be filled, or ferry would leave stale rows in it.
  int64_t slots = 1;
  for (size_t k = 0; k < lead; ++k) {
    // Lead dims can overflow on their own when a later dim is 0.
    if (!CheckedMul(slots, local[k], &slots)) slots = -1;
    if (slots < 0) break;
  }
  LeadSlots rows_at(local, lead, slots, part_ids.size());
  Outcome out;
  out.placements.reserve(part_ids.size());
  std::vector<std::string> described;
  for (size_t i = 0; i < part_ids.size(); ++i) {
    const FusedPart& part = p.parts[i];
    const ParamSpec& c = ctx.model.params[part_ids[i]];
    if (same_dtype && c.dtype != p.dtype) {
      return Fallback(absl::StrCat(DTypeMismatch(p.dtype, c.dtype), " in part ",
                                   c.name));
    }
    if (c.shape.size() != rank) {
      return Fallback(absl::StrCat("part ", c.name, " shape ",
                                   DimsToString(c.shape),
                                   " differs in rank from the other parts"));
    }
    if (part.lead_index.size() != lead) {
      return Fallback(absl::StrCat("part ", c.name, " lead index ",
                                   DimsToString(part.lead_index),
                                   " does not index the ", lead,
                                   " lead dims of local shape ",
                                   DimsToString(local)));
    }
    for (size_t k = 0; k < lead; ++k) {
      if (part.lead_index[k] < 0 || part.lead_index[k] >= local[k]) {
        return Fallback(absl::StrCat("part ", c.name, " lead index ",
                                     DimsToString(part.lead_index),
                                     " lies outside local shape ",
                                     DimsToString(local)));
      }
    }
    for (size_t j = 0; j < rank; ++j) {
      if (static_cast<int64_t>(j) != d && c.shape[j] != local[lead + j]) {
        return Fallback(absl::StrCat("part ", c.name, " shape ",
                                     DimsToString(c.shape),
                                     " does not match local shape ",
                                     DimsToString(local), " in dim ", lead + j));
      }
    }
    const PartShard s = ShardPart(part, c.shape[d], ctx.tp_size, ctx.tp_rank);
    if (!s.error.empty()) return Fallback(s.error);
    int64_t& at = rows_at.RowsAt(part.lead_index);
    const int64_t row = at;  // where this part's rows start in the slot
    if (!CheckedAdd(at, s.extent, &at)) {
      return Fallback("fused part rows overflow 64 bits");
    }
    if (described.size() < 3) {
      described.push_back(absl::StrCat(
          ShortPartName(p.name, c.name), " ", RangeWord(d), " ", s.start, ":",
          s.start + s.extent,
          s.replicas > 1 ? absl::StrCat(" (x", s.replicas, " replicas)") : ""));
    }
    if (s.extent == 0) continue;
    // Filled, then moved in: emplace_back() would zero it first, and this
    // runs once per expert per rank.
    Placement pl;
    pl.param = part_ids[i];
    pl.box.offset.assign(rank, 0);
    pl.box.offset[d] = s.start;
    pl.box.extent = c.shape;
    pl.box.extent[d] = s.extent;
    pl.local_offset.assign(part.lead_index.begin(), part.lead_index.end());
    pl.local_offset.resize(local.size(), 0);
    pl.local_offset[ld] = row;
    out.placements.push_back(std::move(pl));
  }
  if (static_cast<int64_t>(rows_at.size()) != slots) {
    return Fallback(absl::StrCat("fused parts fill ", rows_at.size(), " of ",
                                 slots, " lead slots of local shape ",
                                 DimsToString(local)));
  }
  for (size_t k = 0; k < rows_at.size(); ++k) {
    const int64_t rows = rows_at.rows(k);
    if (rows != local[ld]) {
      return Fallback(absl::StrCat(
          "fused parts", lead > 0 ? absl::StrCat(" at lead index ",
                                                 DimsToString(rows_at.index(k)))
                                  : "",
          " give ", rows, " ", RangeWord(d), " but local shape ",
          DimsToString(local), " has ", local[ld], " in dim ", ld));
    }
  }
  out.resolution = Resolution::kFused;
  out.reason = absl::StrCat(
      "fused along dim ", d, " (", part_ids.size(), " parts",
      lead > 0 ? absl::StrCat(" in ", slots, " lead slots") : "", "): ",
      absl::StrJoin(described, ", "), part_ids.size() > 3 ? ", ..." : "");
  return out;
}

// A block-quantized tensor is stored in whole blocks along its last dim; a
// box or a local position that cuts a block cannot be copied byte-wise.
std::string BlockMisalignment(const ModelSpec& model, const EngineParam& p,
                              const Outcome& out) {
  if (!IsBlockQuantized(p.dtype) || p.local_shape.empty()) return "";
  const int64_t block = BlockElems(p.dtype);
  const size_t last = p.local_shape.size() - 1;
  const std::string blocks = absl::StrCat(DTypeName(p.dtype), " blocks of ",
                                          block, " elements");
  if (p.local_shape[last] % block != 0) {
    return absl::StrCat("local shape ", DimsToString(p.local_shape),
                        " is not whole ", blocks, " in dim ", last);
  }
  for (const Placement& pl : out.placements) {
    if (pl.box.rank() == 0) continue;  // a scalar has no blocks to cut
    const size_t bl = pl.box.rank() - 1;
    const int64_t cuts[] = {pl.box.offset[bl],
                            pl.box.offset[bl] + pl.box.extent[bl],
                            pl.local_offset.back()};
    for (int64_t at : cuts) {
      if (at % block != 0) {
        return absl::StrCat("split at element ", at, " of dim ", bl, " of ",
                            model.params[pl.param].name, " cuts ", blocks);
      }
    }
  }
  return "";
}

// The decision for one engine parameter on one rank, before the module rule.
// `same_dtype`: a dtype that differs from the checkpoint's falls back
// (false for an FP8 weight: DecideQuantized checks the dtypes).
Outcome Decide(const RankContext& ctx, const EngineParam& p,
               const ParamRefs& refs, bool same_dtype = true) {
  // Fail-closed, cheapest proof first: nothing about the shapes matters when
  // the loader itself may do more than copy.
  if (p.loader == LoaderKind::kCustom) return Fallback("loader is custom");
  if (p.flags != kFlagNone) return Fallback(FlagReason(p.flags));
  if (p.tp_size != ctx.tp_size) {
    return Fallback(absl::StrCat("engine tp_size ", p.tp_size,
                                 " != instance tp_size ", ctx.tp_size));
  }
  Outcome out;
  switch (p.loader) {
    case LoaderKind::kFused:
      out = ResolveFused(ctx, p, refs.parts, same_dtype);
      break;
    case LoaderKind::kReplicated:
    case LoaderKind::kColumn:
    case LoaderKind::kRow:
    case LoaderKind::kVocabParallel: {
      if (refs.plain < 0) {
        return Fallback(absl::StrCat("loader consumes ", refs.whole.size(),
                                     " checkpoint parameters"));
      }
      const ParamSpec& c = ctx.model.params[refs.plain];
      if (same_dtype && c.dtype != p.dtype) {
        return Fallback(DTypeMismatch(p.dtype, c.dtype));
      }
      if (p.loader == LoaderKind::kReplicated) {
        out = ResolveReplicated(p, refs.plain, c);
      } else if (p.loader == LoaderKind::kVocabParallel) {
        out = ResolveVocabParallel(ctx, p, refs.plain, c);
      } else {
        out = ResolveEvenSplit(ctx, p, refs.plain, c);
      }
      break;
    }
    default:
      return Fallback(absl::StrCat("loader kind ", static_cast<int>(p.loader),
                                   " is unknown"));
  }
  if (out.resolution != Resolution::kFallback) {
    const std::string why = BlockMisalignment(ctx.model, p, out);
    if (!why.empty()) return Fallback(why);
  }
  return out;
}

// "fp8 e4m3" for kF8E4M3: how people name the formats.
std::string Fp8Name(DType fp8) {
  return fp8 == DType::kF8E5M2 ? "fp8 e5m2" : "fp8 e4m3";
}

// Whether FP8 weight `p` can go through the engine's loader quantized (a
// quantized fallback, FallbackTensor::quantized): its loader consumes one
// 2-D bf16, f16 or f32 checkpoint parameter, which the rank then receives
// whole as FP8 elements and scales. OK with the decision's reason, or
// INVALID_ARGUMENT naming the parameter and `why` it would fall back.
absl::StatusOr<std::string> ThroughLoader(const ModelSpec& model,
                                          const EngineParam& p, int32_t rank,
                                          const ParamRefs& refs,
                                          absl::string_view why) {
  const auto refuse = [&](absl::string_view what) {
    return ParamError(p, rank,
                      absl::StrCat("is FP8 quantized in flight and ", why,
                                   ", so it goes through the engine's loader "
                                   "quantized, which ", what));
  };
  if (refs.whole.size() != 1) {
    return refuse(absl::StrCat("takes a loader that consumes one checkpoint "
                               "parameter (this one consumes ",
                               refs.whole.size(), ")"));
  }
  const ParamSpec& c = model.params[refs.whole[0]];
  if (!IsFp8Source(c.dtype) || c.shape.size() != 2) {
    return refuse(absl::StrCat("takes a 2-D bf16, f16 or f32 checkpoint "
                               "parameter (", c.name, " is ",
                               DTypeName(c.dtype), " ", DimsToString(c.shape),
                               ")"));
  }
  return absl::StrCat("quantized, through the engine's loader: ",
                      DTypeName(c.dtype), " -> ", Fp8Name(p.dtype), ", ",
                      p.fp8.block_rows, "x", p.fp8.block_cols,
                      " blocks, the whole tensor (", why, ")");
}

// An FP8 weight (EngineParam::fp8): placed by its loader as any parameter
// is, but every box whole blocks of a bf16, f16 or f32 checkpoint
// parameter. What would fall back goes through the engine's loader
// quantized instead (ThroughLoader): its loader takes FP8 checkpoint
// tensors, never the trainer's.
absl::StatusOr<Outcome> DecideQuantized(const RankContext& ctx,
                                        const EngineParam& p,
                                        const ParamRefs& refs) {
  Outcome out = Decide(ctx, p, refs, /*same_dtype=*/false);
  if (out.resolution == Resolution::kFallback) {
    absl::string_view why = out.reason;
    absl::ConsumePrefix(&why, "fallback: ");
    absl::StatusOr<std::string> reason =
        ThroughLoader(ctx.model, p, ctx.tp_rank, refs, why);
    if (!reason.ok()) return reason.status();
    Outcome q;
    q.resolution = Resolution::kQuantized;
    q.through_loader = true;
    q.reason = *std::move(reason);
    return q;
  }
  const Fp8Declaration& f = p.fp8;
  const Dims live(p.local_shape.begin(), p.local_shape.end());
  DType from = DType::kInvalid;
  for (const Placement& pl : out.placements) {
    const ParamSpec& c = ctx.model.params[pl.param];
    if (!IsFp8Source(c.dtype)) {
      return ParamError(
          p, ctx.tp_rank,
          absl::StrCat("checkpoint parameter ", c.name, " is ",
                       DTypeName(c.dtype),
                       "; FP8 in flight quantizes bf16, f16 or f32"));
    }
    if (from == DType::kInvalid) from = c.dtype;
    const Dims at(pl.local_offset.begin(), pl.local_offset.end());
    const std::string cut = Fp8BlockCut(pl.box, c.shape, at, live,
                                        f.block_rows, f.block_cols);
    if (!cut.empty()) {
      return ParamError(p, ctx.tp_rank,
                        absl::StrCat("checkpoint parameter ", c.name, " box ",
                                     BoxToString(pl.box), ": ", cut));
    }
  }
  out.resolution = Resolution::kQuantized;
  out.reason = absl::StrCat(
      "quantized: ", from == DType::kInvalid ? "" : DTypeName(from), " -> ",
      Fp8Name(p.dtype), ", ", f.block_rows, "x", f.block_cols, " blocks; ",
      out.reason);
  return out;
}

// Appends the quantized targets of `placements` in FP8 weight `p`, whose
// scales are `scale`: the weight's element strides and the scale tensor's
// (one float32 per block), over the box's dims, as AppendPieces does for
// pieces. A byte offset that would overflow saturates (validation of the
// live tensors refuses it).
void AppendTargets(const EngineParam& p, const EngineParam& scale,
                   std::vector<Placement>* placements,
                   std::vector<QuantizedTarget>* targets) {
  const Dims weight_strides = RowMajorStrides(p.local_shape);
  const Dims scale_strides = RowMajorStrides(scale.local_shape);
  const size_t n = p.local_shape.size();
  const int64_t scale_bytes = UnitBytes(DType::kF32);
  for (Placement& pl : *placements) {
    QuantizedTarget t;
    t.param = pl.param;
    t.format = p.dtype;
    t.block_rows = p.fp8.block_rows;
    t.block_cols = p.fp8.block_cols;
    int64_t elems = 0, blocks = 0;
    bool fits = true;
    for (size_t i = 0; i < n && fits; ++i) {
      int64_t at = pl.local_offset[i];
      int64_t step;
      fits = CheckedMul(at, weight_strides[i], &step) &&
             CheckedAdd(elems, step, &elems);
      if (i + 2 == n) at /= t.block_rows;
      if (i + 1 == n) at /= t.block_cols;
      fits = fits && CheckedMul(at, scale_strides[i], &step) &&
             CheckedAdd(blocks, step, &blocks);
    }
    int64_t scale_delta = 0;
    t.weight_buffer = p.buffer;
    t.scale_buffer = scale.buffer;
    if (!fits || !CheckedAdd(p.byte_offset, elems, &t.weight_offset) ||
        !CheckedMul(blocks, scale_bytes, &scale_delta) ||
        !CheckedAdd(scale.byte_offset, scale_delta, &t.scale_offset)) {
      t.weight_offset = t.scale_offset = INT64_MAX;
    }
    const size_t k = pl.box.rank();
    t.weight_strides.assign(weight_strides.end() - k, weight_strides.end());
    t.scale_strides.assign(scale_strides.end() - k, scale_strides.end());
    t.box = std::move(pl.box);
    targets->push_back(std::move(t));
  }
}

// ---------------------------------------------------------------------------
// The instance: every rank, then the module rule, then pieces.

// A decision whose direct pieces are already built.
struct Decided {
  int32_t alias_target = -1;  // an alias: its target's index in the table
  Resolution resolution = Resolution::kFallback;
  std::string reason;
  std::vector<int32_t> direct_params;  // what its direct pieces copy
  size_t first_piece = 0;  // its direct pieces: RankWork::pieces
  size_t end_piece = 0;    // [first_piece, end_piece)
  size_t first_target = 0;  // an FP8 weight's: RankWork::targets
  size_t end_target = 0;    // [first_target, end_target)
  bool is_scale = false;    // the scale tensor of an FP8 weight
  bool through_loader = false;  // an FP8 weight's quantized fallback
};

// One rank while the ranks are decided side by side.
struct RankWork {
  const EngineTableView* table = nullptr;
  RankContext ctx;
  absl::flat_hash_set<absl::string_view> seen;  // engine names so far
  // Every engine name -> its index, built only when the table has an
  // alias or an FP8 weight (the first index of a repeated name; repeats
  // are errors).
  absl::flat_hash_map<absl::string_view, size_t> names;
  // The scale tensor of each FP8 weight -> the weight's index.
  absl::flat_hash_map<absl::string_view, size_t> scale_of;
  // By engine parameter. Ranks whose entry names the same checkpoint
  // parameters as rank 0's share rank 0's.
  std::vector<std::shared_ptr<const ParamRefs>> refs;
  std::vector<Decided> decided;  // by engine parameter
  // Direct pieces in engine parameter order, built as each parameter is
  // decided, so that no rank keeps its placements until the module rule.
  std::vector<Piece> pieces;
  std::vector<QuantizedTarget> targets;  // likewise, of FP8 weights
};

// How many pieces a rank can end with, whatever the module rule decides: a
// parameter gives either its direct pieces (at most one per part, or one)
// or staging pieces for what it consumes (at most one per part or consumed
// name, or one). Reserving this up front means the pieces, the bulk of the
// result, are never copied to grow.
size_t PieceBound(const EngineTableView& t) {
  size_t n = 0;
  for (const EngineParam& p : t.params) {
    n += std::max<size_t>({1, p.parts.size(), p.consumes.size()});
  }
  return n;
}

RankWork StartRank(const ModelSpec& model, const EngineTableView& table,
                   int32_t tp_size) {
  RankWork w{&table, RankContext{model, tp_size, table.tp_rank}};
  const size_t n = table.params.size();
  bool aliases = false;
  for (size_t i = 0; i < n; ++i) {
    const EngineParam& p = table.params[i];
    aliases = aliases || !p.alias_of.empty();
    if (p.fp8.declared()) w.scale_of.emplace(p.fp8.scale, i);
  }
  if (aliases || !w.scale_of.empty()) {
    w.names.reserve(n);
    for (size_t i = 0; i < n; ++i) w.names.emplace(table.params[i].name, i);
  }
  w.seen.reserve(n);
  w.refs.reserve(n);
  w.decided.reserve(n);
  w.pieces.reserve(PieceBound(table));
  return w;
}

// Appends the pieces of `placements` in the live tensor of `p`. All share
// the tensor's strides, computed once; a box has only the checkpoint's dims,
// whose strides are the trailing ones (a fused MoE tensor's lead dims have
// none). Same result as Piece::InLocalTensor, minus the per-box work.
void AppendPieces(const EngineParam& p, std::vector<Placement>* placements,
                  std::vector<Piece>* pieces) {
  const Dims strides = RowMajorStrides(StorageShape(p.local_shape, p.dtype));
  const int64_t block = BlockElems(p.dtype);
  const int64_t unit_bytes = UnitBytes(p.dtype);
  for (Placement& pl : *placements) {
    // The local offset in storage units (blocks in the last dim).
    int64_t units = 0;
    for (size_t i = 0; i < pl.local_offset.size(); ++i) {
      const int64_t at = i + 1 == pl.local_offset.size()
                             ? pl.local_offset[i] / block
                             : pl.local_offset[i];
      units += at * strides[i];
    }
    // Filled, then moved in (emplace_back() would zero it first).
    Piece piece;
    piece.param = pl.param;
    piece.box = std::move(pl.box);
    piece.buffer = p.buffer;
    // A byte_offset near 2^63 (a table not yet checked against its buffer)
    // saturates: validation then refuses the piece instead of the sum
    // overflowing.
    int64_t delta;
    if (!CheckedMul(units, unit_bytes, &delta) ||
        !CheckedAdd(p.byte_offset, delta, &piece.byte_offset)) {
      piece.byte_offset = INT64_MAX;
    }
    piece.strides.assign(strides.end() - piece.box.rank(), strides.end());
    pieces->push_back(std::move(piece));
  }
}

// The index of the parameter that alias `i` of rank `w` names, checked:
// another parameter of the rank, not an alias, with the same dtype, shape
// and place in memory (the same bytes, so writing it writes the alias).
absl::StatusOr<int32_t> AliasTarget(const RankWork& w, size_t i) {
  const EngineTableView& t = *w.table;
  const EngineParam& p = t.params[i];
  auto it = w.names.find(p.alias_of);
  if (it == w.names.end() || it->second == i) {
    return ParamError(p, t.tp_rank,
                      absl::StrCat("alias_of '", p.alias_of,
                                   "' names no other engine parameter of "
                                   "the rank"));
  }
  const EngineParam& q = t.params[it->second];
  if (!q.alias_of.empty()) {
    return ParamError(p, t.tp_rank,
                      absl::StrCat("alias_of '", q.name,
                                   "', which is an alias itself (of '",
                                   q.alias_of, "'); name '", q.alias_of,
                                   "' instead"));
  }
  if (q.dtype != p.dtype || q.local_shape != p.local_shape ||
      q.buffer != p.buffer || q.byte_offset != p.byte_offset) {
    return ParamError(
        p, t.tp_rank,
        absl::StrCat("alias_of '", q.name, "' must be the same bytes: ",
                     DTypeName(p.dtype), " ", DimsToString(p.local_shape),
                     " at byte ", p.byte_offset, " of buffer ", p.buffer,
                     " vs ", DTypeName(q.dtype), " ",
                     DimsToString(q.local_shape), " at byte ", q.byte_offset,
                     " of buffer ", q.buffer));
  }
  return static_cast<int32_t>(it->second);
}

// Decides engine parameter `i` of rank `w`. `first`: rank 0, whose
// checkpoint references `w` reuses where it names the same ones.
absl::Status DecideParam(ModelIndex* mi, size_t i, const RankWork* first,
                         RankWork* w) {
  const EngineTableView& table = *w->table;
  const EngineParam& p = table.params[i];
  if (!w->seen.insert(p.name).second) {
    return ParamError(p, table.tp_rank,
                      "appears twice in the rank's parameter table");
  }
  absl::Status s = ValidateLiveTensor(p, table);
  if (!s.ok()) return s;
  if (!p.alias_of.empty()) {
    // Writes nothing of its own: its target's decision speaks for it.
    absl::StatusOr<int32_t> target = AliasTarget(*w, i);
    if (!target.ok()) return target.status();
    w->refs.push_back(std::make_shared<const ParamRefs>());
    Decided& d = w->decided.emplace_back();
    d.alias_target = *target;
    d.first_piece = d.end_piece = w->pieces.size();
    d.first_target = d.end_target = w->targets.size();
    return absl::OkStatus();
  }
  if (auto it = w->scale_of.find(p.name); it != w->scale_of.end()) {
    // The scales of an FP8 weight, written with the weight's blocks; it
    // names no checkpoint parameter (CheckFp8Declarations checked it).
    w->refs.push_back(std::make_shared<const ParamRefs>());
    Decided& d = w->decided.emplace_back();
    d.is_scale = true;
    d.resolution = Resolution::kQuantized;
    d.reason = absl::StrCat("quantized: the block scales of ",
                            table.params[it->second].name);
    d.first_piece = d.end_piece = w->pieces.size();
    d.first_target = d.end_target = w->targets.size();
    return absl::OkStatus();
  }
  if (first != nullptr && i < first->refs.size() &&
      !first->decided[i].is_scale && SameNames(p, first->table->params[i])) {
    w->refs.push_back(first->refs[i]);  // validated there
  } else {
    absl::StatusOr<ParamRefs> refs = ResolveNames(mi, p, table.tp_rank);
    if (!refs.ok()) return refs.status();
    w->refs.push_back(std::make_shared<const ParamRefs>(*std::move(refs)));
  }
  Outcome o;
  if (p.fp8.declared()) {
    absl::StatusOr<Outcome> q = DecideQuantized(w->ctx, p, *w->refs.back());
    if (!q.ok()) return q.status();
    o = *std::move(q);
  } else {
    o = Decide(w->ctx, p, *w->refs.back());
  }
  Decided& d = w->decided.emplace_back();
  d.resolution = o.resolution;
  d.reason = std::move(o.reason);
  d.through_loader = o.through_loader;
  d.first_piece = w->pieces.size();
  d.first_target = w->targets.size();
  if (o.resolution != Resolution::kFallback && !o.through_loader) {
    // What the decision reports it receives, while the boxes are at hand.
    mi->scratch.Clear();
    d.direct_params.reserve(o.placements.size());
    for (const Placement& pl : o.placements) {
      if (mi->scratch.Insert(pl.param)) d.direct_params.push_back(pl.param);
    }
    if (o.resolution == Resolution::kQuantized) {
      const EngineParam& scale = table.params[w->names.at(p.fp8.scale)];
      AppendTargets(p, scale, &o.placements, &w->targets);
    } else {
      AppendPieces(p, &o.placements, &w->pieces);
    }
  }
  d.end_piece = w->pieces.size();
  d.end_target = w->targets.size();
  return absl::OkStatus();
}

// Decides every parameter of ranks [lo, hi) of `work`. The ranks go side
// by side, one engine parameter at a time, because they mostly name the
// same checkpoint parameters (a TP-sharded MoE w13 names every expert on
// every rank): looked up for rank lo, those stay in cache for the others
// instead of streaming the whole model from memory once per rank. Returns
// the lowest rank with an error (its first error in `error`), or hi.
int32_t DecideGroup(ModelIndex* mi, std::vector<RankWork>* work, int32_t lo,
                    int32_t hi, absl::Status* error) {
  size_t params = 0;
  for (int32_t r = lo; r < hi; ++r) {
    params = std::max(params, (*work)[r].table->params.size());
  }
  int32_t failed = hi;  // the lowest rank with an error; ranks after it no
                        // longer matter
  // FP8 declarations first: the decisions rely on them (a scale tensor is
  // known by its weight's declaration).
  for (int32_t r = lo; r < hi; ++r) {
    const RankWork& w = (*work)[r];
    if (w.scale_of.empty()) continue;
    absl::Status s = CheckFp8Declarations(
        w.table->params, absl::StrCat("tp rank ", w.table->tp_rank));
    if (!s.ok()) {
      failed = r;
      *error = std::move(s);
      break;
    }
  }
  for (size_t i = 0; i < params; ++i) {
    for (int32_t r = lo; r < failed; ++r) {
      RankWork& w = (*work)[r];
      if (i >= w.table->params.size()) continue;
      absl::Status s = DecideParam(mi, i, r == lo ? nullptr : &(*work)[lo], &w);
      if (!s.ok()) {
        failed = r;
        *error = std::move(s);
      }
    }
  }
  return failed;
}

// Decides every parameter of every rank, in contiguous groups of ranks
// side by side on PlanningThreads() workers, each with its own index of
// what it validated. Errors are the ones a rank-by-rank pass would return:
// the first of the lowest rank that has one (a checkpoint parameter that
// fails validation fails on every rank that names it).
absl::StatusOr<std::vector<RankWork>> DecideRanks(
    const ModelSpec& model, const ModelNames& names,
    const std::vector<const EngineTableView*>& by_rank) {
  const int32_t tp_size = static_cast<int32_t>(by_rank.size());
  std::vector<RankWork> work;
  work.reserve(tp_size);
  for (const EngineTableView* table : by_rank) {
    work.push_back(StartRank(model, *table, tp_size));
  }
  const int32_t groups = std::max(1, std::min(tp_size, PlanningThreads()));
  auto lo = [&](int32_t g) { return g * tp_size / groups; };
  std::vector<int32_t> failed(groups);
  std::vector<absl::Status> errors(groups);
  ParallelFor(groups, groups, [&](size_t g) {
    ModelIndex mi(model, names);
    const int32_t k = static_cast<int32_t>(g);
    failed[g] = DecideGroup(&mi, &work, lo(k), lo(k + 1), &errors[g]);
  });
  for (int32_t g = 0; g < groups; ++g) {
    if (failed[g] < lo(g + 1)) return std::move(errors[g]);
  }
  return work;
}


// Sends decided FP8 weight i of `w` through the engine's loader quantized
// (ThroughLoader), `why` it falls back: its targets are dropped
// (BuildRank skips them) and it becomes a quantized fallback.
absl::Status SendThroughLoader(RankWork& w, size_t i, absl::string_view why) {
  absl::StatusOr<std::string> reason =
      ThroughLoader(w.ctx.model, w.table->params[i], w.table->tp_rank,
                    *w.refs[i], why);
  if (!reason.ok()) return reason.status();
  Decided& d = w.decided[i];
  d.through_loader = true;
  d.reason = *std::move(reason);
  return absl::OkStatus();
}

// An engine finalizes a module as a unit (vLLM's layerwise reload): if its
// loader runs for one parameter while another was written directly, it can
// copy stale storage over the direct write. So one fallback anywhere in a
// module, on any rank, makes the whole module fall back on every rank. An
// FP8 weight (or its scales) cannot fall back: FAILED_PRECONDITION naming
// it and the parameter that makes its module fall back.
absl::Status ApplyModuleRule(std::vector<RankWork>* work) {
  // Module -> the first parameter that falls back in it: (rank, index).
  absl::flat_hash_map<absl::string_view, std::pair<size_t, size_t>>
      fallback_modules;
  for (size_t r = 0; r < work->size(); ++r) {
    const RankWork& w = (*work)[r];
    for (size_t i = 0; i < w.decided.size(); ++i) {
      // An alias writes nothing, so it cannot mix with anything.
      // A quantized fallback goes through the loader too.
      if (w.decided[i].alias_target < 0 &&
          (w.decided[i].resolution == Resolution::kFallback ||
           w.decided[i].through_loader)) {
        fallback_modules.emplace(ModuleOf(w.table->params[i].name),
                                 std::make_pair(r, i));
      }
    }
  }
  if (fallback_modules.empty()) return absl::OkStatus();
  for (RankWork& w : *work) {
    for (size_t i = 0; i < w.decided.size(); ++i) {
      const absl::string_view module = ModuleOf(w.table->params[i].name);
      Decided& d = w.decided[i];
      if (d.resolution == Resolution::kQuantized && d.alias_target < 0) {
        // An FP8 weight goes through the loader quantized; its scales
        // come with it (their decision stands).
        auto it = fallback_modules.find(module);
        if (it == fallback_modules.end() || d.is_scale || d.through_loader) {
          continue;
        }
        const RankWork& cause = (*work)[it->second.first];
        absl::Status s = SendThroughLoader(
            w, i,
            absl::StrCat("its module ", module.empty() ? "(root)" : module,
                         " falls back: ",
                         cause.table->params[it->second.second].name,
                         " on tp rank ", cause.table->tp_rank, " (",
                         cause.decided[it->second.second].reason, ")"));
        if (!s.ok()) return s;
        continue;
      }
      if (d.resolution != Resolution::kFallback &&
          fallback_modules.contains(module)) {
        // Its direct pieces stay in RankWork::pieces; BuildRank drops them.
        d.resolution = Resolution::kFallback;
        d.reason = Fallback(absl::StrCat("module ",
                                         module.empty() ? "(root)" : module,
                                         " mixes direct and fallback"))
                       .reason;
      }
    }
  }
  return absl::OkStatus();
}

// Turns a rank's final decisions into its result: the direct pieces of
// parameters still direct, and one staging buffer per checkpoint parameter
// it receives whole. Consumes `w`.
ResolvedRank BuildRank(const ModelSpec& model, RankWork* w) {
  const EngineTableView& t = *w->table;
  ResolvedRank out;
  out.layout.rank = t.tp_rank;
  out.layout.node = std::string(t.node);
  out.layout.buffer_bytes.assign(t.buffer_bytes.begin(), t.buffer_bytes.end());
  out.decisions.reserve(t.params.size());
  std::vector<Piece>& pieces = w->pieces;
  std::vector<bool> staged(model.params.size(), false);
  std::set<int32_t> quantized_staged;  // quantized fallbacks, by parameter
  size_t kept = 0;  // pieces[0, kept) are final
  for (size_t i = 0; i < t.params.size(); ++i) {
    Decided& o = w->decided[i];
    const ParamRefs& refs = *w->refs[i];
    ParamDecision& d = out.decisions.emplace_back();
    d.engine_name = t.params[i].name;
    if (o.alias_target >= 0) {
      // The target's final resolution (after the module rule); the target
      // receives the bytes, so the alias receives nothing itself.
      const std::string& target = t.params[o.alias_target].name;
      d.resolution = w->decided[o.alias_target].resolution;
      d.reason = absl::StrCat("alias of ", target,
                              ": its bytes are written once, through ",
                              target);
      continue;
    }
    d.resolution = o.resolution;
    d.reason = std::move(o.reason);
    if (o.through_loader) {
      // Its one checkpoint parameter (ThroughLoader), quantized: the FP8
      // elements under its own name, the scales under the declared scale
      // tensor's, for the engine's loader.
      const EngineParam& p = t.params[i];
      d.checkpoint_params = refs.whole;
      const int32_t id = refs.whole[0];
      if (!quantized_staged.insert(id).second) continue;
      for (const bool scales : {false, true}) {
        FallbackTensor f;
        f.param = id;
        f.staging_buffer =
            kStagingBufferBit | static_cast<uint32_t>(out.fallback.size());
        f.format = p.dtype;
        f.block_rows = p.fp8.block_rows;
        f.block_cols = p.fp8.block_cols;
        f.scales = scales;
        f.name = scales ? p.fp8.scale : model.params[id].name;
        out.fallback.push_back(std::move(f));
      }
      continue;
    }
    out.quantized.insert(
        out.quantized.end(),
        std::make_move_iterator(w->targets.begin() + o.first_target),
        std::make_move_iterator(w->targets.begin() + o.end_target));
    if (o.resolution == Resolution::kFallback) {
      // Two loaders consuming one checkpoint tensor share its staging copy.
      d.checkpoint_params = refs.whole;
      for (int32_t id : refs.whole) {
        if (staged[id]) continue;
        staged[id] = true;
        const uint32_t k = static_cast<uint32_t>(out.fallback.size());
        FallbackTensor f;
        f.param = id;
        f.staging_buffer = kStagingBufferBit | k;
        out.fallback.push_back(std::move(f));
      }
      continue;  // any direct pieces it had (module rule) are overwritten
    }
    // Slide the pieces down over those of demoted parameters, if any.
    if (kept != o.first_piece) {
      std::move(pieces.begin() + o.first_piece, pieces.begin() + o.end_piece,
                pieces.begin() + kept);
    }
    d.checkpoint_params = std::move(o.direct_params);
    kept += o.end_piece - o.first_piece;
  }
  pieces.erase(pieces.begin() + kept, pieces.end());
  // Within the capacity PieceBound reserved: no reallocation.
  for (const FallbackTensor& f : out.fallback) {
    // A quantized fallback's pieces are of tensors the model does not have
    // yet: AddFp8Sources (core/fp8_sources.h) adds both.
    if (f.quantized()) continue;
    const ParamSpec& c = model.params[f.param];
    pieces.push_back(Piece::Contiguous(f.param, FullBox(c.shape),
                                       f.staging_buffer, 0, c.dtype));
  }
  out.layout.pieces = std::move(pieces);
  return out;
}

}  // namespace

ParamSpec FallbackSpec(const ModelSpec& model, const FallbackTensor& f) {
  const ParamSpec& c = model.params[f.param];
  if (!f.quantized()) return c;
  if (f.scales) {
    return {f.name, DType::kF32,
            Fp8ScaleShape(c.shape, f.block_rows, f.block_cols)};
  }
  return {f.name, f.format, c.shape};
}

absl::StatusOr<ResolvedInstance> ResolveDestinationLayout(
    const ModelSpec& model, const std::vector<EngineTable>& tables,
    LoadFormat format) {
  std::vector<EngineTableView> views;
  views.reserve(tables.size());
  for (const EngineTable& t : tables) views.push_back(EngineTableView::Of(t));
  return ResolveDestinationLayout(model, views, format);
}

absl::StatusOr<ResolvedInstance> ResolveDestinationLayout(
    const ModelSpec& model, const std::vector<EngineTableView>& tables,
    LoadFormat format) {
  absl::StatusOr<std::vector<const EngineTableView*>> by_rank =
      OrderTables(tables);
  if (!by_rank.ok()) return by_rank.status();
  const ModelNames names(model);
  absl::StatusOr<std::vector<RankWork>> work =
      DecideRanks(model, names, *by_rank);
  if (!work.ok()) return work.status();
  if (format == LoadFormat::kFallbackOnly) {
    // As the module rule does: direct pieces stay in RankWork::pieces and
    // BuildRank drops them; an alias follows its target.
    for (RankWork& w : *work) {
      for (size_t i = 0; i < w.decided.size(); ++i) {
        Decided& d = w.decided[i];
        if (d.alias_target >= 0 || d.resolution == Resolution::kFallback) {
          continue;
        }
        if (d.resolution == Resolution::kQuantized) {
          if (d.is_scale || d.through_loader) continue;
          absl::Status s =
              SendThroughLoader(w, i, "load_format is fallback_only");
          if (!s.ok()) return s;
          continue;
        }
        d.resolution = Resolution::kFallback;
        d.reason = Fallback("load_format fallback_only").reason;
      }
    }
  }
  if (absl::Status s = ApplyModuleRule(&*work); !s.ok()) return s;
  if (format == LoadFormat::kDirectOnly) {
    for (const RankWork& w : *work) {
      for (size_t i = 0; i < w.decided.size(); ++i) {
        const Decided& d = w.decided[i];
        if (d.alias_target < 0 &&
            (d.resolution == Resolution::kFallback || d.through_loader)) {
          return absl::FailedPreconditionError(absl::StrCat(
              "load_format direct_only: engine parameter ",
              w.table->params[i].name, " on tp rank ", w.table->tp_rank,
              " would need the engine's loader (", d.reason, ")"));
        }
      }
    }
  }
  ResolvedInstance out;
  out.ranks.resize(work->size());
  ParallelFor(work->size(), PlanningThreads(), [&](size_t r) {
    out.ranks[r] = BuildRank(model, &(*work)[r]);
  });
  return out;
}

}  // namespace ferry
