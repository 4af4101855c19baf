#include "core/models/trainer_layout.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/models/layout_math.h"
#include "core/models/param_role.h"

namespace ferry {
namespace {

// How one parameter spreads over the ranks of a stage.
enum class SplitMode : uint8_t {
  kReplicated,       // whole on every rank of its stage
  kDim,              // `dim` split over tp ranks in whole granules
  kGroupReplicated,  // fewer granules (kv heads) than tp ranks: rank r holds
                     // granule r * granules / tp
  kVocab,            // dim 0 over tp ranks, local tensors padded (Megatron)
  kExpert,           // whole on the one EP rank that owns the expert
  kFusedQkv,         // q_proj of a fused linear_qkv (k/v folded in)
  kSkip,             // k/v already placed by their layer's kFusedQkv
};

struct ParamPlan {
  SplitMode mode = SplitMode::kReplicated;
  int dim = 0;
  int64_t granule = 1;
  int stage = 0;
  bool also_last_stage = false;  // tied embedding: copy on the last stage
  int32_t k = -1, v = -1;        // kFusedQkv: the k_proj and v_proj params
};

// Megatron's default make_vocab_size_divisible_by.
constexpr int64_t kMegatronVocabMultiple = 128;

// Everything the per-parameter planning needs to know about the model.
struct ModelView {
  const ModelSpec& model;
  const ModelConfig& config;
  std::vector<ParamRole> roles;
  std::vector<int> stage_of_layer;  // layers past the end: the last stage
  int pp = 1;

  int StageOf(const ParamRole& role) const {
    if (role.layer >= 0) {
      return role.layer < static_cast<int64_t>(stage_of_layer.size())
                 ? stage_of_layer[role.layer]
                 : pp - 1;
    }
    if (role.kind == ParamKind::kLmHead || role.module == "model.norm") {
      return pp - 1;
    }
    return 0;  // embedding and any other top-level tensor
  }

  // The FP8 block size when `id` is a block-scaled weight (it has a
  // `<name>_scale_inv` companion), else 0.
  int64_t Fp8Block(int32_t id) const {
    if (config.fp8_block <= 0) return 0;
    return model.Find(model.params[id].name + "_scale_inv") >= 0
               ? config.fp8_block
               : 0;
  }
};

int64_t Lcm(int64_t a, int64_t b) { return std::lcm(a, b); }

// Rows of one head in a column-parallel weight, so that splits never cut a
// head in two; 1 when the config does not say.
int64_t HeadRows(ParamKind kind, const ModelConfig& c) {
  switch (kind) {
    case ParamKind::kQProj:
    case ParamKind::kKProj:
    case ParamKind::kVProj:
      return std::max<int64_t>(c.head_dim, 1);
    case ParamKind::kQBProj:
      return std::max<int64_t>(c.qk_nope_head_dim + c.qk_rope_head_dim, 1);
    case ParamKind::kKVBProj:
      return std::max<int64_t>(c.qk_nope_head_dim + c.v_head_dim, 1);
    default:
      return 1;
  }
}

// Plans a weight (or bias). Scales are planned from their weight.
ParamPlan PlanWeight(const ModelView& view, int32_t id, int tp) {
  const ParamSpec& p = view.model.params[id];
  const ParamRole& role = view.roles[id];
  ParamPlan plan;
  plan.stage = view.StageOf(role);
  const int64_t fp8 = view.Fp8Block(id);

  if (IsRoutedExpert(role.kind) && role.expert >= 0) {
    plan.mode = SplitMode::kExpert;
    return plan;
  }
  if ((role.kind == ParamKind::kEmbedding || role.kind == ParamKind::kLmHead) &&
      p.shape.size() == 2 && fp8 == 0 && !IsBlockQuantized(p.dtype)) {
    plan.mode = SplitMode::kVocab;
    plan.also_last_stage = role.kind == ParamKind::kEmbedding &&
                           view.config.tie_word_embeddings && role.layer < 0;
    return plan;
  }
  // MLA: q_a_proj and kv_a_proj_with_mqa are small down projections that
  // Megatron builds duplicated (not TP-split) in its MLA attention; they,
  // the MLA norms and anything unrecognised stay replicated, which is
  // always a correct (if not the cheapest) layout.
  int dim = -1;
  if (IsColumnParallel(role.kind)) {
    dim = 0;  // weight and, as Megatron does, the bias
  } else if (IsRowParallel(role.kind) && !role.is_bias) {
    dim = 1;  // a row-parallel bias is added after the reduce: replicated
  }
  if (dim < 0 || static_cast<int>(p.shape.size()) <= dim) return plan;

  int64_t granule = dim == 0 ? HeadRows(role.kind, view.config) : 1;
  if (fp8 > 0) granule = Lcm(granule, fp8);  // whole FP8 blocks
  if (dim + 1 == static_cast<int>(p.shape.size()) &&
      IsBlockQuantized(p.dtype)) {
    granule = Lcm(granule, BlockElems(p.dtype));  // never inside a block
  }
  plan.dim = dim;
  plan.granule = granule;
  const int64_t units = CeilDiv(p.shape[dim], granule);
  if (units >= tp) {
    plan.mode = SplitMode::kDim;
  } else if ((role.kind == ParamKind::kKProj ||
              role.kind == ParamKind::kVProj) &&
             fp8 == 0) {
    plan.mode = SplitMode::kGroupReplicated;  // GQA: tp > kv heads
  }
  // Otherwise too few blocks for every rank to get one: replicated, with
  // its scale (PlanScale copies the mode).
  return plan;
}

// A weight_scale_inv follows its weight: same stage, same mode, same dim,
// on scale rows (one per block), so weight block k and scale row k land on
// the same rank.
ParamPlan PlanScale(const ModelView& view, const ParamPlan& weight_plan,
                    int32_t weight) {
  ParamPlan plan = weight_plan;
  plan.also_last_stage = false;
  const int64_t fp8 = view.Fp8Block(weight);
  if (plan.mode == SplitMode::kDim ||
      plan.mode == SplitMode::kGroupReplicated) {
    plan.granule = fp8 > 0 ? plan.granule / fp8 : 1;
  }
  return plan;
}

absl::Status PlanFusedQkv(const ModelView& view, int32_t q, int tp,
                          std::vector<ParamPlan>* plans) {
  const ParamRole& role = view.roles[q];
  const ModelConfig& c = view.config;
  const int32_t k = view.model.Find(absl::StrCat(
      role.module.substr(0, role.module.size() - 6), "k_proj.weight"));
  const int32_t v = view.model.Find(absl::StrCat(
      role.module.substr(0, role.module.size() - 6), "v_proj.weight"));
  if (k < 0 || v < 0 || view.Fp8Block(q) > 0 ||
      IsBlockQuantized(view.model.params[q].dtype)) {
    return absl::OkStatus();  // nothing to fuse: plain column-parallel q/k/v
  }
  if (c.head_dim <= 0 || c.num_kv_heads <= 0 ||
      c.num_attention_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fused qkv: ", role.module, " needs head_dim and heads divisible by ",
        "kv heads (heads ", c.num_attention_heads, ", kv heads ",
        c.num_kv_heads, ")"));
  }
  if (c.num_kv_heads < tp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fused qkv needs at least one kv group per rank: ", c.num_kv_heads,
        " kv heads < tp ", tp));
  }
  (*plans)[q].mode = SplitMode::kFusedQkv;
  (*plans)[q].k = k;
  (*plans)[q].v = v;
  (*plans)[k].mode = SplitMode::kSkip;
  (*plans)[v].mode = SplitMode::kSkip;
  return absl::OkStatus();
}

// Builds one rank's local tensors in checkpoint order.
class RankBuilder {
 public:
  RankBuilder(const ModelSpec& model, RankLayout* layout)
      : model_(model), layout_(layout) {}

  // A local tensor holding exactly `box` of `param`.
  void AddBox(int32_t param, Box box) {
    const DType dtype = model_.params[param].dtype;
    const int64_t offset = packer_.Place(TensorBytes(box.extent, dtype));
    layout_->pieces.push_back(
        Piece::Contiguous(param, std::move(box), 0, offset, dtype));
  }

  // A local tensor of `local_shape` (e.g. padded) whose first rows hold
  // `box`. Allocated even when `box` is empty (a padding-only shard).
  void AddPadded(int32_t param, Box box, const Dims& local_shape) {
    const DType dtype = model_.params[param].dtype;
    const int64_t offset = packer_.Place(TensorBytes(local_shape, dtype));
    if (Volume(box) == 0) return;
    layout_->pieces.push_back(
        Piece::InLocalTensor(param, std::move(box), 0, offset, local_shape,
                             Dims(local_shape.size(), 0), dtype));
  }

  // Allocates a local tensor and returns its offset; pieces come after.
  int64_t Allocate(const Dims& local_shape, DType dtype) {
    return packer_.Place(TensorBytes(local_shape, dtype));
  }
  void AddPiece(Piece piece) { layout_->pieces.push_back(std::move(piece)); }

  void Finish() { layout_->buffer_bytes = {packer_.size()}; }

 private:
  static int64_t TensorBytes(const Dims& shape, DType dtype) {
    return Volume(StorageShape(shape, dtype)) * UnitBytes(dtype);
  }

  const ModelSpec& model_;
  RankLayout* layout_;
  BufferPacker packer_;
};

Box WithRange(const Dims& shape, int dim, Range r) {
  Box box = FullBox(shape);
  box.offset[dim] = r.begin;
  box.extent[dim] = r.size();
  return box;
}

// Megatron linear_qkv on one TP rank: for each local kv group g (global
// group G), its q heads, its k head, its v head, stacked along dim 0.
void AddFusedQkv(const ModelView& view, const ParamPlan& plan, int32_t q,
                 int tp, int tp_rank, RankBuilder* out) {
  const ModelConfig& c = view.config;
  const int64_t hd = c.head_dim;
  const int64_t q_per_group = c.num_attention_heads / c.num_kv_heads;
  const int64_t group_rows = (q_per_group + 2) * hd;
  const Range groups = SplitRange(c.num_kv_heads, tp, tp_rank);
  const ParamSpec& qp = view.model.params[q];
  const Dims local{groups.size() * group_rows, qp.shape[1]};
  const int64_t offset = out->Allocate(local, qp.dtype);
  for (int64_t g = 0; g < groups.size(); ++g) {
    const int64_t global = groups.begin + g;
    const int64_t row = g * group_rows;
    const struct {
      int32_t param;
      Range rows;
      int64_t local_row;
    } blocks[] = {
        {q, {global * q_per_group * hd, (global + 1) * q_per_group * hd}, row},
        {plan.k, {global * hd, (global + 1) * hd}, row + q_per_group * hd},
        {plan.v,
         {global * hd, (global + 1) * hd},
         row + (q_per_group + 1) * hd},
    };
    for (const auto& b : blocks) {
      const ParamSpec& p = view.model.params[b.param];
      out->AddPiece(Piece::InLocalTensor(b.param, WithRange(p.shape, 0, b.rows),
                                         0, offset, local, {b.local_row, 0},
                                         p.dtype));
    }
  }
}

absl::Status CheckParallelism(const TrainerParallelism& par) {
  if (par.tp < 1 || par.pp < 1 || par.dp < 1 || par.ep < 1 ||
      par.ranks_per_node < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("trainer parallelism sizes must be >= 1 (tp ", par.tp,
                     ", pp ", par.pp, ", dp ", par.dp, ", ep ", par.ep,
                     ", ranks_per_node ", par.ranks_per_node, ")"));
  }
  if (static_cast<int64_t>(par.tp) * par.pp * par.dp > (1 << 20)) {
    return absl::InvalidArgumentError("trainer world is over 2^20 ranks");
  }
  if (!par.fsdp && (par.tp * par.dp) % par.ep != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ep ", par.ep, " must divide tp * dp = ", par.tp * par.dp));
  }
  return absl::OkStatus();
}

std::string NodeName(const TrainerParallelism& par, int rank) {
  return absl::StrCat(par.node_prefix, rank / par.ranks_per_node);
}

// FSDP: the parameters flattened (in storage units) and concatenated in
// checkpoint order; rank r holds units [r*S, (r+1)*S) with S = ceil(total /
// world), contiguous in its buffer 0 (the last rank's padding is not
// allocated). A flat range of one parameter is a few boxes (geometry.h).
std::vector<RankLayout> BuildFsdpLayout(const ModelSpec& model,
                                        const TrainerParallelism& par) {
  const int world = par.tp * par.pp * par.dp;
  std::vector<int64_t> start(model.params.size() + 1, 0);
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ParamSpec& p = model.params[i];
    start[i + 1] = start[i] + Volume(StorageShape(p.shape, p.dtype));
  }
  const int64_t shard = CeilDiv(start.back(), world);
  std::vector<RankLayout> ranks(world);
  for (int r = 0; r < world; ++r) {
    RankLayout& layout = ranks[r];
    layout.rank = r;
    layout.node = NodeName(par, r);
    const int64_t begin = std::min(start.back(), r * shard);
    const int64_t end = std::min(start.back(), begin + shard);
    // First parameter that ends after `begin`.
    size_t i = std::upper_bound(start.begin() + 1, start.end(), begin) -
               start.begin() - 1;
    int64_t byte = 0;
    for (; i < model.params.size() && start[i] < end; ++i) {
      const ParamSpec& p = model.params[i];
      const int64_t lo = std::max(begin, start[i]) - start[i];
      const int64_t hi = std::min(end, start[i + 1]) - start[i];
      for (Box box : FlatRangeToBoxes(StorageShape(p.shape, p.dtype), lo, hi)) {
        const int64_t bytes = Volume(box) * UnitBytes(p.dtype);
        if (!box.offset.empty()) {  // storage units back to elements
          box.offset.back() *= BlockElems(p.dtype);
          box.extent.back() *= BlockElems(p.dtype);
        }
        layout.pieces.push_back(Piece::Contiguous(
            static_cast<int32_t>(i), std::move(box), 0, byte, p.dtype));
        byte += bytes;
      }
    }
    layout.buffer_bytes = {RoundUp(byte, kTensorAlignment)};
  }
  return ranks;
}

}  // namespace

absl::StatusOr<std::vector<RankLayout>> BuildTrainerLayout(
    const ModelSpec& model, const ModelConfig& config,
    const TrainerParallelism& par) {
  if (absl::Status s = CheckParallelism(par); !s.ok()) return s;
  if (par.fsdp) return BuildFsdpLayout(model, par);

  ModelView view{model, config, {}, {}, par.pp};
  view.roles.reserve(model.params.size());
  int64_t num_layers = config.num_layers;
  int64_t num_experts = config.num_experts;
  for (const ParamSpec& p : model.params) {
    view.roles.push_back(ClassifyParam(p.name));
    if (config.num_layers == 0) {
      num_layers = std::max(num_layers, view.roles.back().layer + 1);
    }
    num_experts = std::max(num_experts, view.roles.back().expert + 1);
  }
  for (int s = 0; s < par.pp; ++s) {
    const Range layers = SplitRange(num_layers, par.pp, s);
    view.stage_of_layer.resize(layers.end, s);
  }

  std::vector<ParamPlan> plans(model.params.size());
  for (size_t i = 0; i < model.params.size(); ++i) {
    if (!view.roles[i].is_scale) {
      plans[i] = PlanWeight(view, static_cast<int32_t>(i), par.tp);
    }
  }
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ParamRole& role = view.roles[i];
    if (role.is_scale) {
      const int32_t weight = model.Find(role.module + ".weight");
      plans[i] = weight >= 0 ? PlanScale(view, plans[weight], weight)
                             : ParamPlan{SplitMode::kReplicated, 0, 1,
                                         view.StageOf(role)};
    } else if (par.fused_qkv && role.kind == ParamKind::kQProj &&
               !role.is_bias && plans[i].mode == SplitMode::kDim) {
      if (absl::Status s =
              PlanFusedQkv(view, static_cast<int32_t>(i), par.tp, &plans);
          !s.ok()) {
        return s;
      }
    }
  }

  // Routed expert e lives on EP rank owner[e] (contiguous blocks of
  // experts, ceil/floor when ep does not divide the count).
  std::vector<int> owner(num_experts, 0);
  for (int r = 0; r < par.ep; ++r) {
    const Range experts = SplitRange(num_experts, par.ep, r);
    for (int64_t e = experts.begin; e < experts.end; ++e) owner[e] = r;
  }

  const int world = par.tp * par.pp * par.dp;
  std::vector<RankLayout> ranks(world);
  for (int rank = 0; rank < world; ++rank) {
    const int tp_rank = rank % par.tp;
    const int dp_rank = (rank / par.tp) % par.dp;
    const int stage = rank / (par.tp * par.dp);
    const int ep_rank = (tp_rank + par.tp * dp_rank) % par.ep;
    RankLayout& layout = ranks[rank];
    layout.rank = rank;
    layout.node = NodeName(par, rank);
    RankBuilder out(model, &layout);
    for (size_t i = 0; i < model.params.size(); ++i) {
      const ParamPlan& plan = plans[i];
      const bool on_stage =
          plan.stage == stage || (plan.also_last_stage && stage == par.pp - 1);
      if (!on_stage) continue;
      const int32_t id = static_cast<int32_t>(i);
      const Dims& shape = model.params[i].shape;
      switch (plan.mode) {
        case SplitMode::kSkip:
          break;
        case SplitMode::kReplicated:
          out.AddBox(id, FullBox(shape));
          break;
        case SplitMode::kExpert:
          if (owner[view.roles[i].expert] == ep_rank) {
            out.AddBox(id, FullBox(shape));
          }
          break;
        case SplitMode::kDim:
          out.AddBox(id, WithRange(shape, plan.dim,
                                   SplitRange(shape[plan.dim], par.tp, tp_rank,
                                              plan.granule)));
          break;
        case SplitMode::kGroupReplicated: {
          const int64_t units = CeilDiv(shape[plan.dim], plan.granule);
          const int64_t u = static_cast<int64_t>(tp_rank) * units / par.tp;
          out.AddBox(
              id, WithRange(shape, plan.dim,
                            {u * plan.granule, std::min((u + 1) * plan.granule,
                                                        shape[plan.dim])}));
          break;
        }
        case SplitMode::kVocab: {
          const int64_t per =
              RoundUp(shape[0], kMegatronVocabMultiple * par.tp) / par.tp;
          const int64_t begin = std::min(shape[0], tp_rank * per);
          const int64_t end = std::min(shape[0], begin + per);
          Dims local = shape;
          local[0] = per;
          out.AddPadded(id, WithRange(shape, 0, {begin, end}), local);
          break;
        }
        case SplitMode::kFusedQkv:
          AddFusedQkv(view, plan, id, par.tp, tp_rank, &out);
          break;
      }
    }
    out.Finish();
  }
  return ranks;
}

}  // namespace ferry
