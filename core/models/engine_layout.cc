#include "core/models/engine_layout.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/models/layout_math.h"
#include "core/models/param_role.h"

namespace ferry {
namespace {

constexpr int64_t kVllmVocabPadding = 64;  // DEFAULT_VOCAB_PADDING_SIZE

// The last component of a name: "weight", "bias", "weight_scale_inv".
std::string Suffix(const std::string& name) {
  return name.substr(name.rfind('.') + 1);
}

// Builds the tables of all TP ranks of one instance. Each Add* call emits
// one live parameter on every rank; `consumed_` marks checkpoint tensors a
// fused parameter already took.
class TableBuilder {
 public:
  TableBuilder(const ModelSpec& model, const ModelConfig& config,
               const EngineParallelism& par)
      : model_(model),
        config_(config),
        par_(par),
        tp_(par.tp),
        tables_(par.tp),
        packers_(par.tp),
        consumed_(model.params.size(), false) {
    for (int r = 0; r < tp_; ++r) {
      tables_[r].tp_rank = r;
      tables_[r].tp_size = tp_;
      tables_[r].node = absl::StrCat(
          par.node_prefix, (par.first_device + r) / par.ranks_per_node);
    }
  }

  absl::Status AddAll() {
    for (size_t i = 0; i < model_.params.size(); ++i) {
      if (consumed_[i]) continue;
      const int32_t id = static_cast<int32_t>(i);
      const ParamRole role = ClassifyParam(model_.params[i].name);
      absl::Status s;
      if (IsRoutedExpert(role.kind) && role.layer >= 0) {
        s = AddExperts(role);
      } else {
        s = AddDense(id, role);
      }
      if (!s.ok()) return s;
    }
    for (int r = 0; r < tp_; ++r) {
      tables_[r].buffer_bytes = {packers_[r].size()};
    }
    return absl::OkStatus();
  }

  std::vector<EngineTable> Take() { return std::move(tables_); }

 private:
  const ParamSpec& P(int32_t id) const { return model_.params[id]; }

  absl::Status Error(const std::string& name, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " at tp ", tp_, ": ", what));
  }

  // Emits `rank_param(r)` on each rank r, placing it in buffer 0.
  template <typename F>
  void Emit(F rank_param) {
    for (int r = 0; r < tp_; ++r) {
      EngineParam p = rank_param(r);
      // Ranks declare the same parts (each holds a shard of every part):
      // one list for all of them (see FusedParts).
      if (r > 0 && p.parts == tables_[r - 1].params.back().parts) {
        p.parts = tables_[r - 1].params.back().parts;
      }
      p.tp_size = tp_;
      p.buffer = 0;
      p.byte_offset = packers_[r].Place(
          Volume(StorageShape(p.local_shape, p.dtype)) * UnitBytes(p.dtype));
      tables_[r].params.push_back(std::move(p));
    }
  }

  EngineParam Make(std::string name, int32_t like, Dims local_shape,
                   LoaderKind loader, int shard_dim = 0) const {
    EngineParam p;
    p.name = std::move(name);
    p.dtype = P(like).dtype;
    p.local_shape = std::move(local_shape);
    p.loader = loader;
    p.shard_dim = shard_dim;
    return p;
  }

  // The same parameter on every rank.
  void EmitSame(EngineParam p) {
    Emit([&](int) { return p; });
  }

  absl::StatusOr<int64_t> Divide(int64_t size, int64_t by,
                                 const std::string& name,
                                 absl::string_view what) const {
    if (by <= 0 || size % by != 0) {
      return Error(name,
                   absl::StrCat(what, " ", size, " does not divide by ", by));
    }
    return size / by;
  }

  // Local rows of a tp-split output dim that FP8 block scaling needs whole
  // blocks of (vLLM's validate_block_quant_shapes).
  absl::Status CheckBlocks(int32_t weight, int64_t local) const {
    if (config_.fp8_block > 0 && HasScale(weight) &&
        local % config_.fp8_block != 0) {
      return Error(P(weight).name,
                   absl::StrCat("shard of ", local, " is not whole ",
                                config_.fp8_block, "-blocks"));
    }
    return absl::OkStatus();
  }

  bool HasScale(int32_t weight) const {
    return model_.Find(P(weight).name + "_scale_inv") >= 0;
  }

  absl::Status AddDense(int32_t id, const ParamRole& role) {
    const ParamSpec& p = P(id);
    const std::string suffix = Suffix(p.name);
    const std::string prefix =
        role.module.substr(0, role.module.rfind('.') + 1);
    switch (role.kind) {
      case ParamKind::kQProj:
        return AddQkv(id, prefix, suffix);
      case ParamKind::kGateProj:
        return AddGateUp(id, prefix, suffix);
      case ParamKind::kEmbedding:
      case ParamKind::kLmHead:
        if (p.shape.size() == 2 && !role.is_scale) return AddVocab(id);
        break;
      case ParamKind::kOProj:
      case ParamKind::kDownProj:
        if (!role.is_bias && p.shape.size() == 2) return AddSplit(id, 1, 0);
        break;
      case ParamKind::kKProj:
      case ParamKind::kVProj:
      case ParamKind::kUpProj:
      case ParamKind::kQBProj:
        return AddSplit(id, 0, 0);  // only when not fused with a sibling
      case ParamKind::kKVBProj:
        // vLLM's MLA absorbs kv_b_proj into W_UK / W_UV after loading: the
        // live tensor is derived, so it must go through the loader.
        return AddSplit(id, 0, kFlagTransformed);
      default:
        break;
    }
    // Norms, router gates and biases, MLA down projections (q_a_proj,
    // kv_a_proj_with_mqa: ReplicatedLinear in vLLM) and unknown tensors.
    EmitSame(Make(p.name, id, p.shape, LoaderKind::kReplicated));
    return absl::OkStatus();
  }

  // A column (dim 0) or row (dim 1) split; weights, scales and biases.
  absl::Status AddSplit(int32_t id, int dim, uint32_t flags) {
    const ParamSpec& p = P(id);
    if (static_cast<int>(p.shape.size()) <= dim) {
      EmitSame(Make(p.name, id, p.shape, LoaderKind::kReplicated));
      return absl::OkStatus();
    }
    auto local = Divide(p.shape[dim], tp_, p.name, "split dim");
    if (!local.ok()) return local.status();
    if (absl::Status s = CheckBlocks(id, *local); !s.ok()) return s;
    Dims shape = p.shape;
    shape[dim] = *local;
    EngineParam e =
        Make(p.name, id, shape,
             dim == 0 ? LoaderKind::kColumn : LoaderKind::kRow, dim);
    e.flags = flags;
    EmitSame(std::move(e));
    return absl::OkStatus();
  }

  absl::Status AddVocab(int32_t id) {
    const ParamSpec& p = P(id);
    const int64_t padded = EnginePaddedVocab(p.shape[0], tp_);
    EmitSame(Make(p.name, id, {padded / tp_, p.shape[1]},
                  LoaderKind::kVocabParallel));
    return absl::OkStatus();
  }

  // qkv_proj: q rows split by tp; kv heads split, or replicated one head
  // per rank when tp > kv heads (vLLM's num_kv_head_replicas).
  absl::Status AddQkv(int32_t q, const std::string& prefix,
                      const std::string& suffix) {
    const int32_t k = model_.Find(prefix + "k_proj." + suffix);
    const int32_t v = model_.Find(prefix + "v_proj." + suffix);
    if (k < 0 || v < 0) return AddSplit(q, 0, 0);
    const std::string name = prefix + "qkv_proj." + suffix;
    const int64_t heads = config_.num_attention_heads;
    const int64_t kv = config_.num_kv_heads;
    if (heads <= 0 || kv <= 0 || P(q).shape[0] % heads != 0 ||
        P(k).shape[0] % kv != 0) {
      return Error(name, "needs num_attention_heads and num_key_value_heads");
    }
    if (heads % tp_ != 0 || (kv % tp_ != 0 && tp_ % kv != 0)) {
      return Error(name, absl::StrCat(heads, " heads / ", kv,
                                      " kv heads do not split over tp"));
    }
    consumed_[k] = consumed_[v] = true;
    if (suffix == "weight_scale_inv") {
      // Per-head scale rows of an FP8 q/k/v (no model here has one) do not
      // follow the head split exactly: the engine's loader places them.
      const Dims shape{P(q).shape[0] + P(k).shape[0] + P(v).shape[0],
                       P(q).shape.size() > 1 ? P(q).shape[1] : 1};
      EngineParam e = Make(name, q, shape, LoaderKind::kCustom);
      e.consumes = {P(q).name, P(k).name, P(v).name};
      EmitSame(std::move(e));
      return absl::OkStatus();
    }
    const int64_t q_rows = P(q).shape[0] / tp_;
    const int64_t kv_rows = P(k).shape[0] / kv * std::max<int64_t>(1, kv / tp_);
    Dims shape = P(q).shape;
    shape[0] = q_rows + 2 * kv_rows;
    EngineParam e = Make(name, q, shape, LoaderKind::kFused, 0);
    // Shapes alone cannot tell replicated kv heads from an even split of a
    // head; the live table says how many rows each rank holds.
    const int64_t kv_extent = tp_ > kv ? kv_rows : 0;
    e.parts = {{P(q).name, {}},
               {P(k).name, {}, kv_extent},
               {P(v).name, {}, kv_extent}};
    EmitSame(std::move(e));
    return absl::OkStatus();
  }

  // gate_up_proj (and, for FP8, gate_up_proj.weight_scale_inv).
  absl::Status AddGateUp(int32_t gate, const std::string& prefix,
                         const std::string& suffix) {
    const int32_t up = model_.Find(prefix + "up_proj." + suffix);
    if (up < 0) return AddSplit(gate, 0, 0);
    const std::string name = prefix + "gate_up_proj." + suffix;
    auto local = Divide(P(gate).shape[0], tp_, name, "intermediate size");
    if (!local.ok()) return local.status();
    if (absl::Status s = CheckBlocks(gate, *local); !s.ok()) return s;
    consumed_[up] = true;
    Dims shape = P(gate).shape;
    shape[0] = 2 * *local;
    EngineParam e = Make(name, gate, shape, LoaderKind::kFused, 0);
    e.parts = {{P(gate).name, {}}, {P(up).name, {}}};
    EmitSame(std::move(e));
    return absl::OkStatus();
  }

  // FusedMoE of one layer: w13 and w2 (and their FP8 scales) for all its
  // experts, emitted when the layer's first expert tensor comes up.
  absl::Status AddExperts(const ParamRole& role) {
    const std::string base =
        absl::StrCat("model.layers.", role.layer, ".mlp.experts.");
    const int64_t num = config_.num_experts;
    std::vector<int32_t> gate(num), up(num), down(num);
    for (int64_t e = 0; e < num; ++e) {
      const std::string ex = absl::StrCat(base, e, ".");
      gate[e] = model_.Find(ex + "gate_proj.weight");
      up[e] = model_.Find(ex + "up_proj.weight");
      down[e] = model_.Find(ex + "down_proj.weight");
      if (gate[e] < 0 || up[e] < 0 || down[e] < 0) {
        return Error(ex + "*", "expert gate/up/down_proj missing");
      }
    }
    for (int64_t e = 0; e < num; ++e) {
      for (int32_t id : {gate[e], up[e], down[e]}) {
        consumed_[id] = true;
        const int32_t scale = model_.Find(P(id).name + "_scale_inv");
        if (scale >= 0) consumed_[scale] = true;
      }
    }
    // Experts whole (EP: E/tp per rank) or every expert TP-split.
    const std::string w13 = base + "w13_weight";
    int64_t local_experts = num, inter = P(gate[0]).shape[0];
    if (par_.expert_parallel) {
      auto n = Divide(num, tp_, w13, "expert count");
      if (!n.ok()) return n.status();
      local_experts = *n;
    } else {
      auto i = Divide(inter, tp_, w13, "moe intermediate size");
      if (!i.ok()) return i.status();
      inter = *i;
    }
    if (absl::Status s = CheckBlocks(gate[0], inter); !s.ok()) return s;
    const int64_t hidden = P(gate[0]).shape[1];
    const int64_t block = config_.fp8_block;
    const bool scaled = block > 0 && HasScale(gate[0]);

    // The experts rank r holds, by local index.
    auto expert_of = [&](int r, int64_t l) {
      return par_.expert_parallel ? r * local_experts + l : l;
    };
    // With EP a part is whole on its rank: its local extent (`part_rows`)
    // says so, as an even split would be rows / tp.
    auto emit = [&](const std::string& name, int32_t like, Dims shape,
                    int shard_dim, bool scales, bool w13_parts,
                    int64_t part_rows) {
      const std::string tail = scales ? "_scale_inv" : "";
      const int64_t extent = par_.expert_parallel ? part_rows : 0;
      Emit([&](int r) {
        EngineParam p = Make(name, like, shape, LoaderKind::kFused, shard_dim);
        std::vector<FusedPart> parts;
        parts.reserve(local_experts * (w13_parts ? 2 : 1));
        for (int64_t l = 0; l < local_experts; ++l) {
          const int64_t e = expert_of(r, l);
          if (w13_parts) {
            parts.push_back({P(gate[e]).name + tail, {l}, extent});
            parts.push_back({P(up[e]).name + tail, {l}, extent});
          } else {
            parts.push_back({P(down[e]).name + tail, {l}, extent});
          }
        }
        p.parts = FusedParts(std::move(parts));
        return p;
      });
    };
    emit(w13, gate[0], {local_experts, 2 * inter, hidden}, 0, false, true,
         inter);
    emit(base + "w2_weight", down[0], {local_experts, hidden, inter}, 1, false,
         false, inter);
    if (scaled) {
      const int32_t scale = model_.Find(P(gate[0]).name + "_scale_inv");
      const int64_t si = CeilDiv(inter, block), sh = CeilDiv(hidden, block);
      emit(base + "w13_weight_scale_inv", scale, {local_experts, 2 * si, sh}, 0,
           true, true, si);
      emit(base + "w2_weight_scale_inv", scale, {local_experts, sh, si}, 1,
           true, false, si);
    }
    return absl::OkStatus();
  }

  const ModelSpec& model_;
  const ModelConfig& config_;
  const EngineParallelism& par_;
  const int tp_;
  std::vector<EngineTable> tables_;
  std::vector<BufferPacker> packers_;
  std::vector<bool> consumed_;
};

}  // namespace

int64_t EnginePaddedVocab(int64_t vocab, int tp) {
  const int64_t padded = RoundUp(vocab, kVllmVocabPadding);
  return padded % tp == 0 ? padded : RoundUp(vocab, kVllmVocabPadding * tp);
}

absl::StatusOr<std::vector<EngineTable>> BuildEngineTables(
    const ModelSpec& model, const ModelConfig& config,
    const EngineParallelism& par) {
  if (par.tp < 1 || par.tp > 4096 || par.ranks_per_node < 1 ||
      par.first_device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("engine parallelism: tp ", par.tp, ", ranks_per_node ",
                     par.ranks_per_node, ", first_device ", par.first_device));
  }
  TableBuilder builder(model, config, par);
  if (absl::Status s = builder.AddAll(); !s.ok()) return s;
  return builder.Take();
}

}  // namespace ferry
