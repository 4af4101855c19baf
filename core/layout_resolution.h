// Layout resolution: from an inference engine's parameter table to pieces.
//
// An engine (vLLM/SGLang-style) does not think in checkpoint parameters; it
// has live parameters (possibly fused, sharded, padded) and a loader per
// parameter that knows how to copy a checkpoint tensor into it. Resolution
// decides, per engine parameter and per rank, whether ferry can write the
// checkpoint bytes straight into the live parameter (`direct`: pieces into
// the rank's registered buffer) or must hand whole checkpoint tensors to the
// engine's own loader (`fallback`: pieces into daemon staging).
//
// It is fail-closed, after vLLM's M2N destination resolution: a custom or
// unknown loader, a wrapped loader, packing, transposition, pre-sharded
// storage, an engine TP size that is not the instance's, or a shape that does
// not validate means fallback; and a module (the name up to its last '.')
// that mixes direct and fallback falls back whole on every rank, because an
// engine finalizes a module as a unit. ferry goes further than vLLM: a fused
// parameter whose parts the engine declares (qkv_proj = q,k,v; gate_up_proj
// = gate,up; MoE w13 per expert) resolves to direct pieces.
//
// An FP8 weight fed from a wider checkpoint parameter (core/fp8_targets.h)
// resolves `quantized`: whole blocks of the checkpoint placed into the live
// weight and its scale tensor, or an error; it has no fallback.
//
// Every decision carries a one-line reason a person can read.
#ifndef FERRY_CORE_LAYOUT_RESOLUTION_H_
#define FERRY_CORE_LAYOUT_RESOLUTION_H_

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "core/fp8_targets.h"
#include "core/piece.h"

namespace ferry {

// How an engine parameter's loader places a checkpoint tensor.
enum class LoaderKind : uint8_t {
  kReplicated,     // whole tensor on every rank (norms, ReplicatedLinear)
  kColumn,         // split along `shard_dim` (output dim), even
  kRow,            // split along `shard_dim` (input dim), even
  // Split evenly along dim 0 of the padded vocabulary (embeddings,
  // lm_head): the padding is at the end, so trailing ranks may hold
  // padding rows, or only padding.
  kVocabParallel,
  kFused,          // concatenation of declared parts (qkv_proj, gate_up, w13)
  kCustom,         // anything else: always fallback
};

// Flags that signal a transform ferry cannot reproduce (vLLM's packed_dim,
// marlin_tile_size, is_transposed, is_sharded_weight, a wrapped loader).
enum EngineParamFlag : uint32_t {
  kFlagNone = 0,
  kFlagPacked = 1u << 0,      // packed / repacked storage (marlin, int4 pack)
  kFlagTransposed = 1u << 1,  // stored transposed relative to the checkpoint
  kFlagPreSharded = 1u << 2,  // checkpoint is already sharded on disk
  kFlagWrappedLoader = 1u << 3,  // loader is a wrapper/partial: unknowable
  kFlagTransformed = 1u << 4,    // model-level load_weights transforms it
};

// One part of a fused engine parameter.
struct FusedPart {
  std::string checkpoint_name;  // e.g. "...self_attn.k_proj.weight"
  // Indices into the leading dims the engine adds in front of the
  // checkpoint tensor's dims (MoE: {expert}); empty for qkv/gate_up.
  Dims lead_index;
  // Rows of this part along `shard_dim` in the live tensor. 0 means an even
  // split (the part's checkpoint extent / tp). Shapes alone cannot tell a
  // replicated part: 2 kv heads of 128 rows at TP 4 are 256 rows, which
  // split "evenly" into 64-row halves of a head, yet vLLM gives each rank
  // one whole head (128 rows, each held by 2 ranks). The engine knows its
  // heads per partition and says so here; a value larger than the even
  // split means replicated over groups of extent * tp / rows ranks.
  int64_t local_extent = 0;

  bool operator==(const FusedPart& o) const {
    return checkpoint_name == o.checkpoint_name &&
           lead_index == o.lead_index && local_extent == o.local_extent;
  }
};

// The parts of one fused parameter: an immutable list whose storage equal
// lists may share. The list repeats: every TP rank of a MoE layer declares
// the same expert parts (names, expert index, extent), only the live
// tensor's shape and offset differ. Kimi-K2 at TP 16 declares 2,304 parts
// per layer and rank: 2.2M parts over the 16 ranks, about 320 MiB when each
// rank held its own. Shared, each list is held once (BuildEngineTables
// shares them between its ranks, ferryd's registry between registrations). Build a std::vector and wrap it; a list
// is never changed in place, so a shared one is never changed under
// another holder.
class FusedParts {
 public:
  FusedParts() = default;
  FusedParts(std::initializer_list<FusedPart> parts)
      : FusedParts(std::vector<FusedPart>(parts)) {}
  FusedParts(std::vector<FusedPart> parts)  // NOLINT: a value conversion
      : v_(parts.empty() ? nullptr
                         : std::make_shared<const std::vector<FusedPart>>(
                               std::move(parts))) {}
  // Wraps a list held elsewhere (an interned one); null is the empty list.
  explicit FusedParts(std::shared_ptr<const std::vector<FusedPart>> held)
      : v_(held == nullptr || held->empty() ? nullptr : std::move(held)) {}

  const std::vector<FusedPart>& get() const { return v_ ? *v_ : Empty(); }
  // The storage, for an interner; null when empty.
  const std::shared_ptr<const std::vector<FusedPart>>& held() const {
    return v_;
  }
  size_t size() const { return get().size(); }
  bool empty() const { return get().empty(); }
  const FusedPart& operator[](size_t i) const { return get()[i]; }
  const FusedPart& back() const { return get().back(); }
  std::vector<FusedPart>::const_iterator begin() const {
    return get().begin();
  }
  std::vector<FusedPart>::const_iterator end() const { return get().end(); }
  // Whether both hold the same storage (not merely equal parts).
  bool SharesWith(const FusedParts& o) const { return v_ == o.v_; }
  bool operator==(const FusedParts& o) const {
    return v_ == o.v_ || get() == o.get();
  }
  bool operator!=(const FusedParts& o) const { return !(*this == o); }

 private:
  static const std::vector<FusedPart>& Empty();
  std::shared_ptr<const std::vector<FusedPart>> v_;
};

// One live engine parameter on one rank.
struct EngineParam {
  std::string name;  // engine's name, e.g. "...self_attn.qkv_proj.weight"
  DType dtype = DType::kInvalid;
  Dims local_shape;      // shape of this rank's live tensor, elements
  uint32_t buffer = 0;   // registered buffer holding it
  int64_t byte_offset = 0;  // where it starts in that buffer (contiguous)
  LoaderKind loader = LoaderKind::kCustom;
  int32_t tp_size = 1;    // the loader's TP size (must equal the instance's)
  int32_t shard_dim = 0;  // kColumn/kRow/kFused: the split dim, in the
                          // checkpoint tensor's dims
  uint32_t flags = kFlagNone;
  // kFused: the parts, concatenated along `shard_dim` in order within each
  // lead_index group. Each part is split evenly across TP ranks, or, when it
  // has fewer rows than ranks need (GQA kv heads, TP > kv heads), replicated
  // over groups of ranks.
  FusedParts parts;
  // kCustom or fallback: the checkpoint parameters the loader consumes.
  // Empty means the one named `name`.
  std::vector<std::string> consumes;
  // Tied parameters (lm_head.weight stored in model.embed_tokens.weight):
  // the name of another parameter of the same rank whose live bytes this
  // one is: same dtype, local shape, buffer and byte offset, and not an
  // alias itself. The bytes are written once, through that parameter; an
  // alias gets no pieces and needs no checkpoint tensor. Empty: none.
  std::string alias_of;
  // A live FP8 weight (dtype kF8E4M3 or kF8E5M2) fed from the bf16, f16 or
  // f32 checkpoint parameter its loader names, quantized in flight; its
  // scales are the parameter `fp8.scale` of the same rank
  // (core/fp8_targets.h). Not declared: a plain parameter.
  Fp8Declaration fp8;

  bool operator==(const EngineParam& o) const;
  bool operator!=(const EngineParam& o) const { return !(*this == o); }
};

// An engine rank's parameter table.
struct EngineTable {
  int32_t tp_rank = 0;
  int32_t tp_size = 1;
  std::string node;
  std::vector<EngineParam> params;
  std::vector<int64_t> buffer_bytes;  // registered buffer sizes, by id
};

// An engine rank's table as the resolver reads it, its lists held by the
// caller: ferryd's registry shares one parameter list among the replicas
// that registered it (daemon/registry/table_interner.h), and copying 16 ranks' lists
// of 140,000 parameters to resolve them cost more than resolving.
struct EngineTableView {
  int32_t tp_rank = 0;
  int32_t tp_size = 1;
  absl::string_view node;  // outlives the call, as the lists do
  absl::Span<const EngineParam> params;
  absl::Span<const int64_t> buffer_bytes;

  static EngineTableView Of(const EngineTable& t) {
    return EngineTableView{t.tp_rank, t.tp_size, t.node, t.params,
                           t.buffer_bytes};
  }
};

// kQuantized: an FP8 weight filled block by block from a wider checkpoint
// parameter (its ResolvedRank::quantized targets), or the scale tensor of
// one (which receives the blocks' scales).
enum class Resolution : uint8_t { kDirect, kFused, kFallback, kQuantized };
// "direct", "fused", "fallback", "quantized"
const char* ResolutionName(Resolution r);

struct ParamDecision {
  std::string engine_name;
  Resolution resolution = Resolution::kFallback;
  std::string reason;                // one line, e.g. "column shard dim 0"
  std::vector<int32_t> checkpoint_params;  // what it receives
};

// A fallback checkpoint tensor a rank receives whole, in daemon staging
// buffer `staging_buffer` (has kStagingBufferBit), row-major.
struct FallbackTensor {
  int32_t param = -1;
  uint32_t staging_buffer = 0;
  // A quantized fallback (FP8 in flight through the engine's loader: an
  // FP8 weight its loader transforms, or whose module falls back): the
  // rank receives `param` quantized, its FP8 elements in `format` or
  // (`scales`) its f32 block scales, under the name the loader knows
  // (`name`: the checkpoint parameter's, or the declared scale tensor's).
  // kInvalid: the checkpoint tensor as it is.
  DType format = DType::kInvalid;
  int64_t block_rows = 0;
  int64_t block_cols = 0;
  bool scales = false;
  std::string name;

  bool quantized() const { return format != DType::kInvalid; }
};

// What staging holds for `f` and what the engine's loader is handed: the
// checkpoint parameter, or for a quantized fallback its FP8 tensor (same
// shape) or its scales (f32, the block grid), named f.name.
ParamSpec FallbackSpec(const ModelSpec& model, const FallbackTensor& f);

struct ResolvedRank {
  RankLayout layout;  // direct pieces and staging pieces of fallback tensors
  std::vector<FallbackTensor> fallback;
  // The boxes the rank's FP8 weights receive quantized, in engine
  // parameter order (none of them is in `layout`: a piece copies bytes).
  std::vector<QuantizedTarget> quantized;
  std::vector<ParamDecision> decisions;  // one per engine parameter
};

struct ResolvedInstance {
  std::vector<ResolvedRank> ranks;  // by TP rank
};

// The FP8 declarations of one rank's parameter table on their own, before
// any model is known (registration checks them, resolution again; the code
// is in fp8_declarations.cc): a declared weight is not an alias, is
// f8_e4m3 or f8_e5m2, has at least two dims and block sizes in
// [1, 2^20]; its `fp8.scale` names another parameter of the rank that is
// not declared itself, not an alias and no other weight's scale, of dtype
// f32 and shape Fp8ScaleShape. INVALID_ARGUMENT "<who>: engine parameter
// <name>: ..." otherwise.
absl::Status CheckFp8Declarations(absl::Span<const EngineParam> params,
                                  absl::string_view who);

// Resolves every rank of one instance. `tables` holds one table per TP rank
// (any order). Errors (INVALID_ARGUMENT, naming the engine parameter, the
// rank and the box): duplicate or missing TP ranks, tables that disagree on
// tp_size, a checkpoint name the model does not have, a negative or
// overflowing shape, a live parameter outside its registered buffer, two
// engine parameters of a rank with the same name, an alias_of that names no
// parameter of the rank, an alias, or one stored elsewhere or otherwise.
// An alias's decision reports its target's resolution, with the reason
// "alias of <target>: ...", and no checkpoint parameters. FP8 weights
// (EngineParam::fp8): a declaration that breaks a rule of
// CheckFp8Declarations, a checkpoint parameter that is not bf16, f16 or
// f32, a loader ferry cannot reproduce or a box that cuts a block
// (Fp8BlockCut) is INVALID_ARGUMENT naming the parameter and rank, since
// such a weight has no fallback; and FAILED_PRECONDITION when its module
// falls back for another parameter's sake or the load format is
// fallback_only. Everything else that ferry
// cannot prove safe (including a dtype that differs from the checkpoint's:
// the engine's loader converts) is a fallback with its reason, never an
// error.
//
// `format` is the instance's load format (Lifecycle.UpdateConfig
// `load_format`, docs/api.md): kAuto as above; kFallbackOnly resolves every
// parameter as fallback (the engine's loader takes every tensor, as vLLM's
// own load path does); kDirectOnly refuses instead of falling back:
// FAILED_PRECONDITION naming the first parameter, its rank and why it would
// fall back.
enum class LoadFormat : uint8_t { kAuto, kDirectOnly, kFallbackOnly };
absl::StatusOr<ResolvedInstance> ResolveDestinationLayout(
    const ModelSpec& model, const std::vector<EngineTable>& tables,
    LoadFormat format = LoadFormat::kAuto);
// The same, on views of tables held elsewhere.
absl::StatusOr<ResolvedInstance> ResolveDestinationLayout(
    const ModelSpec& model, const std::vector<EngineTableView>& tables,
    LoadFormat format = LoadFormat::kAuto);

}  // namespace ferry

#endif  // FERRY_CORE_LAYOUT_RESOLUTION_H_
