#include "daemon/table_interner.h"

#include <utility>

#include "absl/hash/hash.h"

namespace ferry {

uint64_t DigestOf(const EngineParams& params) {
  uint64_t h = params.size();
  auto mix = [&h](uint64_t v) {
    h = (h ^ v) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  };
  const absl::Hash<std::string> text;
  const absl::Hash<Dims> dims;
  for (const EngineParam& p : params) {
    mix(text(p.name));
    mix(static_cast<uint64_t>(p.dtype));
    mix(dims(p.local_shape));
    mix(p.buffer);
    mix(static_cast<uint64_t>(p.byte_offset));
    mix(static_cast<uint64_t>(p.loader));
    mix(static_cast<uint64_t>(p.tp_size));
    mix(static_cast<uint64_t>(p.shard_dim));
    mix(p.flags);
    mix(text(p.alias_of));
    mix(p.parts.size());
    for (const FusedPart& part : p.parts) {
      mix(text(part.checkpoint_name));
      mix(dims(part.lead_index));
      mix(static_cast<uint64_t>(part.local_extent));
    }
    mix(p.consumes.size());
    for (const std::string& c : p.consumes) mix(text(c));
  }
  return h;
}

uint64_t DigestOf(const ParamSpecs& params) {
  uint64_t h = params.size();
  auto mix = [&h](uint64_t v) {
    h = (h ^ v) * 0x9E3779B97F4A7C15ull;
    h ^= h >> 29;
  };
  const absl::Hash<std::string> text;
  const absl::Hash<Dims> dims;
  for (const ParamSpec& p : params) {
    mix(text(p.name));
    mix(static_cast<uint64_t>(p.dtype));
    mix(dims(p.shape));
  }
  return h;
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
