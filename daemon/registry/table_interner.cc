#include "daemon/registry/table_interner.h"

#include <utility>

#include "absl/hash/hash.h"

namespace ferry {
namespace {

// Folds words into a 64-bit digest: xor in, multiply by an odd constant,
// fold the high bits down (as core/plan.cc's plan digest).
class Digest {
 public:
  explicit Digest(uint64_t seed) : h_(seed) {}
  void Add(uint64_t v) {
    h_ = (h_ ^ v) * 0x9E3779B97F4A7C15ull;
    h_ ^= h_ >> 29;
  }
  void Add(const std::string& s) { Add(absl::Hash<std::string>{}(s)); }
  void Add(const Dims& d) { Add(absl::Hash<Dims>{}(d)); }
  void Add(const FusedPart& part) {
    Add(part.checkpoint_name);
    Add(part.lead_index);
    Add(static_cast<uint64_t>(part.local_extent));
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_;
};

}  // namespace

uint64_t DigestOf(const EngineParams& params) {
  Digest h(params.size());
  for (const EngineParam& p : params) {
    h.Add(p.name);
    h.Add(static_cast<uint64_t>(p.dtype));
    h.Add(p.local_shape);
    h.Add(p.buffer);
    h.Add(static_cast<uint64_t>(p.byte_offset));
    h.Add(static_cast<uint64_t>(p.loader));
    h.Add(static_cast<uint64_t>(p.tp_size));
    h.Add(static_cast<uint64_t>(p.shard_dim));
    h.Add(p.flags);
    h.Add(p.alias_of);
    h.Add(p.fp8.scale);
    h.Add(static_cast<uint64_t>(p.fp8.block_rows));
    h.Add(static_cast<uint64_t>(p.fp8.block_cols));
    h.Add(p.parts.size());
    if (!p.parts.empty()) {
      h.Add(p.parts[0]);
      h.Add(p.parts.back());
    }
    h.Add(p.consumes.size());
    for (const std::string& c : p.consumes) h.Add(c);
  }
  return h.value();
}

uint64_t DigestOf(const ParamSpecs& params) {
  Digest h(params.size());
  for (const ParamSpec& p : params) {
    h.Add(p.name);
    h.Add(static_cast<uint64_t>(p.dtype));
    h.Add(p.shape);
  }
  return h.value();
}

uint64_t DigestOf(const PartsList& parts) {
  Digest h(parts.size());
  for (const FusedPart& part : parts) h.Add(part);
  return h.value();
}

std::shared_ptr<const EngineParams> ShareParts(
    std::shared_ptr<const EngineParams> params, PartsInterner* parts) {
  if (params == nullptr) return params;
  std::shared_ptr<EngineParams> copy;  // made at the first list replaced
  for (size_t i = 0; i < params->size(); ++i) {
    const FusedParts& own = (*params)[i].parts;
    if (own.empty()) continue;
    std::shared_ptr<const PartsList> held = parts->Intern(own.held());
    if (held == own.held()) continue;
    if (copy == nullptr) copy = std::make_shared<EngineParams>(*params);
    (*copy)[i].parts = FusedParts(std::move(held));
  }
  if (copy == nullptr) return params;
  return copy;
}

bool SameSpecs(const ParamSpecs& a, const ParamSpecs& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].name != b[i].name || a[i].dtype != b[i].dtype ||
        a[i].shape != b[i].shape) {
      return false;
    }
  }
  return true;
}

}  // namespace ferry
