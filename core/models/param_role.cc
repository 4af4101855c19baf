#include "core/models/param_role.h"

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"

namespace ferry {
namespace {

// The number right after `marker` in `name` ("model.layers." -> 12), or -1.
int64_t NumberAfter(absl::string_view name, absl::string_view marker) {
  const size_t at = name.find(marker);
  if (at == absl::string_view::npos) return -1;
  absl::string_view rest = name.substr(at + marker.size());
  rest = rest.substr(0, rest.find('.'));
  int64_t n;
  return absl::SimpleAtoi(rest, &n) ? n : -1;
}

ParamKind KindOfModule(absl::string_view leaf, absl::string_view module,
                       bool expert) {
  if (leaf == "embed_tokens") return ParamKind::kEmbedding;
  if (leaf == "lm_head") return ParamKind::kLmHead;
  if (absl::EndsWith(leaf, "norm")) return ParamKind::kNorm;
  if (leaf == "q_proj") return ParamKind::kQProj;
  if (leaf == "k_proj") return ParamKind::kKProj;
  if (leaf == "v_proj") return ParamKind::kVProj;
  if (leaf == "o_proj") return ParamKind::kOProj;
  if (leaf == "gate_proj") {
    return expert ? ParamKind::kExpertGate : ParamKind::kGateProj;
  }
  if (leaf == "up_proj") {
    return expert ? ParamKind::kExpertUp : ParamKind::kUpProj;
  }
  if (leaf == "down_proj") {
    return expert ? ParamKind::kExpertDown : ParamKind::kDownProj;
  }
  if (leaf == "gate" && absl::EndsWith(module, ".mlp.gate")) {
    return ParamKind::kRouter;
  }
  if (leaf == "q_a_proj") return ParamKind::kQAProj;
  if (leaf == "kv_a_proj_with_mqa") return ParamKind::kKVAProj;
  if (leaf == "q_b_proj") return ParamKind::kQBProj;
  if (leaf == "kv_b_proj") return ParamKind::kKVBProj;
  return ParamKind::kOther;
}

}  // namespace

ParamRole ClassifyParam(absl::string_view name) {
  ParamRole role;
  const size_t dot = name.rfind('.');
  if (dot == absl::string_view::npos) return role;
  const absl::string_view last = name.substr(dot + 1);
  const absl::string_view module = name.substr(0, dot);
  role.module = std::string(module);
  role.layer = absl::StartsWith(name, "model.layers.")
                   ? NumberAfter(name, "model.layers.")
                   : -1;
  role.expert = NumberAfter(name, ".experts.");
  role.shared_expert = absl::StrContains(name, ".shared_experts.");
  role.is_scale = last == "weight_scale_inv";
  role.is_bias = last == "bias";
  if (last == "e_score_correction_bias") {
    role.kind = ParamKind::kRouter;
    return role;
  }
  if (last != "weight" && !role.is_scale && !role.is_bias) return role;
  const size_t leaf_dot = module.rfind('.');
  const absl::string_view leaf = leaf_dot == absl::string_view::npos
                                     ? module
                                     : module.substr(leaf_dot + 1);
  role.kind = KindOfModule(leaf, module, role.expert >= 0);
  return role;
}

bool IsColumnParallel(ParamKind kind) {
  switch (kind) {
    case ParamKind::kQProj:
    case ParamKind::kKProj:
    case ParamKind::kVProj:
    case ParamKind::kGateProj:
    case ParamKind::kUpProj:
    case ParamKind::kQBProj:
    case ParamKind::kKVBProj:
      return true;
    default:
      return false;
  }
}

bool IsRowParallel(ParamKind kind) {
  return kind == ParamKind::kOProj || kind == ParamKind::kDownProj;
}

bool IsRoutedExpert(ParamKind kind) {
  return kind == ParamKind::kExpertGate || kind == ParamKind::kExpertUp ||
         kind == ParamKind::kExpertDown;
}

}  // namespace ferry
