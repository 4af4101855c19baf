// ModelSpec: the checkpoint parameters of one stream (one model), the names
// both sides of a sync agree on. Pieces (piece.h) and plans index into it.
#ifndef FERRY_CORE_MODEL_SPEC_H_
#define FERRY_CORE_MODEL_SPEC_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/geometry.h"

namespace ferry {

// One checkpoint parameter.
struct ParamSpec {
  std::string name;  // e.g. "model.layers.0.self_attn.q_proj.weight"
  DType dtype = DType::kInvalid;
  Dims shape;  // global shape, elements
};

// The parameters of one stream (one model). Index = parameter id used by
// pieces and plans.
struct ModelSpec {
  std::vector<ParamSpec> params;

  // Index of `name`, or -1.
  int32_t Find(const std::string& name) const;
  // Builds the name index; call after filling params. When params are
  // already in name order (ferryd's models are), Find searches them and no
  // index is built: a Kimi-K2 model's copy of 140,000 names and its sort
  // were a tenth of a plan.
  void BuildIndex();

 private:
  bool in_name_order_ = false;
  std::vector<std::pair<std::string, int32_t>> sorted_;  // name -> index
};

}  // namespace ferry

#endif  // FERRY_CORE_MODEL_SPEC_H_
