#include "core/model_spec.h"

#include <algorithm>

namespace ferry {

int32_t ModelSpec::Find(const std::string& name) const {
  if (in_name_order_) {
    auto it = std::lower_bound(
        params.begin(), params.end(), name,
        [](const ParamSpec& p, const std::string& n) { return p.name < n; });
    if (it == params.end() || it->name != name) return -1;
    return static_cast<int32_t>(it - params.begin());
  }
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
  in_name_order_ = std::is_sorted(
      params.begin(), params.end(),
      [](const ParamSpec& a, const ParamSpec& b) { return a.name < b.name; });
  if (in_name_order_) return;
  sorted_.reserve(params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    sorted_.emplace_back(params[i].name, static_cast<int32_t>(i));
  }
  std::sort(sorted_.begin(), sorted_.end());
}

}  // namespace ferry
