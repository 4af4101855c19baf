#include "daemon/registry/declaration_cache.h"

#include <utility>
#include <vector>

#include "proto/convert.h"

namespace ferry {

bool DeclaresExactly(const DeclaredParameters& params, const ModelSpec& spec) {
  if (static_cast<size_t>(params.size()) != spec.params.size()) return false;
  for (int i = 0; i < params.size(); ++i) {
    const v1::ParameterSpec& p = params.Get(i);
    const ParamSpec& q = spec.params[i];
    if (p.dtype() != DTypeToProto(q.dtype) ||
        static_cast<size_t>(p.shape_size()) != q.shape.size() ||
        p.name() != q.name) {
      return false;
    }
    for (int d = 0; d < p.shape_size(); ++d) {
      if (p.shape(d) != q.shape[d]) return false;
    }
  }
  return true;
}

absl::StatusOr<std::shared_ptr<const ModelSpec>> DeclarationCache::Parse(
    const DeclaredParameters& params, absl::string_view who) {
  std::vector<std::shared_ptr<const ModelSpec>> candidates;
  {
    absl::MutexLock lock(&mu_);
    for (const std::weak_ptr<const ModelSpec>& w : held_) {
      if (std::shared_ptr<const ModelSpec> spec = w.lock()) {
        candidates.push_back(std::move(spec));
      }
    }
  }
  for (std::shared_ptr<const ModelSpec>& spec : candidates) {
    if (!DeclaresExactly(params, *spec)) continue;
    absl::MutexLock lock(&mu_);
    ++hits_;
    return std::move(spec);
  }
  absl::StatusOr<std::shared_ptr<const ModelSpec>> spec =
      DeclarationFromProto(params, who);
  if (!spec.ok()) return spec.status();
  absl::MutexLock lock(&mu_);
  ++parsed_;
  for (auto it = held_.begin(); it != held_.end();) {
    it = it->expired() ? held_.erase(it) : std::next(it);
  }
  held_.push_front(*spec);
  if (held_.size() > capacity_) held_.pop_back();
  return spec;
}

size_t DeclarationCache::hits() const {
  absl::MutexLock lock(&mu_);
  return hits_;
}

size_t DeclarationCache::parsed() const {
  absl::MutexLock lock(&mu_);
  return parsed_;
}

}  // namespace ferry
