#include "core/models/scaled_model.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/models/param_role.h"

namespace ferry {
namespace {

void Override(int64_t value, int64_t* field) {
  if (value > 0) *field = value;
}

// The shape of a Llama-style tensor under config `c`, or an error.
absl::StatusOr<Dims> ScaledShape(const ParamSpec& p, const ParamRole& role,
                                 const ModelConfig& c) {
  const int64_t h = c.hidden_size;
  const int64_t q = c.num_attention_heads * c.head_dim;
  const int64_t kv = c.num_kv_heads * c.head_dim;
  const int64_t i = c.intermediate_size;
  Dims shape;
  switch (role.kind) {
    case ParamKind::kEmbedding:
    case ParamKind::kLmHead:
      shape = {c.vocab_size, h};
      break;
    case ParamKind::kNorm:  // q_norm / k_norm (Qwen3) normalise one head
      shape = {absl::EndsWith(role.module, "q_norm") ||
                       absl::EndsWith(role.module, "k_norm")
                   ? c.head_dim
                   : h};
      break;
    case ParamKind::kQProj:
      shape = {q, h};
      break;
    case ParamKind::kKProj:
    case ParamKind::kVProj:
      shape = {kv, h};
      break;
    case ParamKind::kOProj:
      shape = {h, q};
      break;
    case ParamKind::kGateProj:
    case ParamKind::kUpProj:
      shape = {i, h};
      break;
    case ParamKind::kDownProj:
      shape = {h, i};
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("ScaleModel: cannot reshape ", p.name));
  }
  if (role.is_bias) shape.resize(1);  // a bias has the output dim only
  if (shape.size() != p.shape.size() || role.is_scale) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScaleModel: ", p.name, " is not a Llama-style tensor of shape ",
        DimsToString(p.shape)));
  }
  return shape;
}

}  // namespace

ModelScale DemoScale() {
  ModelScale s;
  s.num_layers = 6;
  s.hidden_size = 2048;
  s.intermediate_size = 7168;
  s.num_attention_heads = 16;
  s.num_kv_heads = 8;
  s.head_dim = 128;
  return s;
}

absl::StatusOr<ModelSchema> ScaleModel(const ModelSchema& base,
                                       const ModelScale& scale) {
  const ModelConfig& b = base.config;
  if (b.is_moe() || b.is_mla() || b.fp8_block > 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScaleModel: ", base.name, " is not a Llama-style dense model"));
  }
  ModelSchema out;
  out.name = absl::StrCat(base.name, "-scaled");
  ModelConfig& c = out.config;
  c = b;
  Override(scale.num_layers, &c.num_layers);
  Override(scale.hidden_size, &c.hidden_size);
  Override(scale.intermediate_size, &c.intermediate_size);
  Override(scale.num_attention_heads, &c.num_attention_heads);
  Override(scale.num_kv_heads, &c.num_kv_heads);
  Override(scale.head_dim, &c.head_dim);
  Override(scale.vocab_size, &c.vocab_size);
  if (c.num_layers > b.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScaleModel: ", c.num_layers, " layers > the base's ", b.num_layers));
  }
  if (c.num_kv_heads <= 0 || c.head_dim <= 0 ||
      c.num_attention_heads % c.num_kv_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ScaleModel: ", c.num_attention_heads, " heads do not group over ",
        c.num_kv_heads, " kv heads of dim ", c.head_dim));
  }
  for (const ParamSpec& p : base.spec.params) {
    const ParamRole role = ClassifyParam(p.name);
    if (role.layer >= c.num_layers) continue;
    auto shape = ScaledShape(p, role, c);
    if (!shape.ok()) return shape.status();
    out.spec.params.push_back(ParamSpec{p.name, p.dtype, std::move(*shape)});
  }
  out.spec.BuildIndex();
  return out;
}

}  // namespace ferry
