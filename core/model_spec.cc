#include "core/model_spec.h"

#include <algorithm>

namespace ferry {

int32_t ModelSpec::Find(const std::string& name) const {
  auto it = std::lower_bound(
      sorted_.begin(), sorted_.end(), name,
      [](const std::pair<std::string, int32_t>& e, const std::string& n) {
        return e.first < n;
      });
  if (it == sorted_.end() || it->first != name) return -1;
  return it->second;
}

void ModelSpec::BuildIndex() {
  sorted_.clear();
  sorted_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    sorted_.emplace_back(params[i].name, static_cast<int32_t>(i));
  }
  std::sort(sorted_.begin(), sorted_.end());
}

}  // namespace ferry
