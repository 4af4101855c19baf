// The one-tensor case that tests of the cluster model and of exchanges
// compute by hand: parameter "w", F32 [8, 4] (128 bytes), held whole by
// one trainer rank.
#ifndef FERRY_TESTS_CORE_ONE_TENSOR_H_
#define FERRY_TESTS_CORE_ONE_TENSOR_H_

#include <string>
#include <vector>

#include "core/model_spec.h"
#include "core/piece.h"

namespace ferry {
namespace testing {

inline ModelSpec OneTensorModel() {
  ModelSpec m;
  m.params.push_back(ParamSpec{"w", DType::kF32, {8, 4}});
  m.BuildIndex();
  return m;
}

// One trainer rank on `node` holding all of "w".
inline std::vector<RankLayout> OneTensorTrainer(const std::string& node) {
  RankLayout r;
  r.node = node;
  r.pieces.push_back(
      Piece::Contiguous(0, Box{{0, 0}, {8, 4}}, 0, 0, DType::kF32));
  return {r};
}

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_CORE_ONE_TENSOR_H_
