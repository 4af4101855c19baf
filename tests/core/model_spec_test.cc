// ModelSpec::Find: every name at its index, in name order or not (in name
// order it searches the parameters themselves, with no index of its own).
#include "core/model_spec.h"

#include <string>
#include <vector>

#include "catch2/catch.hpp"

namespace ferry {
namespace {

ModelSpec Model(const std::vector<std::string>& names) {
  ModelSpec m;
  for (const std::string& n : names) {
    m.params.push_back(ParamSpec{n, DType::kBF16, {4, 4}});
  }
  m.BuildIndex();
  return m;
}

TEST_CASE("Find gives each name's index, in name order and not") {
  const std::vector<std::string> sorted = {
      "lm_head.weight", "model.layers.0.mlp.weight",
      "model.layers.0.self_attn.weight", "model.layers.1.mlp.weight"};
  const std::vector<std::string> shuffled = {
      "model.layers.1.mlp.weight", "lm_head.weight",
      "model.layers.0.self_attn.weight", "model.layers.0.mlp.weight"};
  for (const auto* names : {&sorted, &shuffled}) {
    const ModelSpec m = Model(*names);
    for (size_t i = 0; i < names->size(); ++i) {
      INFO((*names)[i]);
      CHECK(m.Find((*names)[i]) == static_cast<int32_t>(i));
    }
    CHECK(m.Find("model.layers.0") == -1);
    CHECK(m.Find("") == -1);
    CHECK(m.Find("zzz") == -1);
    // A copy finds the same.
    const ModelSpec copy = m;
    CHECK(copy.Find((*names)[2]) == 2);
  }
}

TEST_CASE("Find after params change and BuildIndex again") {
  ModelSpec m = Model({"a", "b", "c"});
  m.params.push_back(ParamSpec{"aa", DType::kBF16, {1}});  // out of order
  m.BuildIndex();
  CHECK(m.Find("aa") == 3);
  CHECK(m.Find("c") == 2);
  m.params.pop_back();
  m.BuildIndex();
  CHECK(m.Find("aa") == -1);
  CHECK(m.Find("b") == 1);
}

TEST_CASE("An empty model finds nothing") {
  ModelSpec m;
  CHECK(m.Find("x") == -1);
  m.BuildIndex();
  CHECK(m.Find("x") == -1);
}

}  // namespace
}  // namespace ferry
