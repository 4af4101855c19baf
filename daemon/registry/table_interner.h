// Equal parameter lists, registered by many ranks, held once.
//
// Two lists repeat across a large job's registrations:
// - an engine's table: every rank of every replica registers its table,
//   and the replicas' tables are equal rank for rank (same names, shapes,
//   parts, buffers, offsets);
// - a stream's declared parameters: every trainer rank declares the
//   parameters of the model (the clients declare the whole model), the
//   same list on every rank.
// Held per participant, Kimi-K2's 256 trainer ranks and 128 engine ranks
// made 2.2 GiB of parsed registrations at 16 layers and 8.7 GiB at 61 on
// the coordinator (docs/benchmarks.md). The registry interns both lists
// here when it adds a participant, so equal ones share one copy; PlanCache
// compares shared tables by pointer.
//
// A third list repeats inside the tables: the TP ranks of an instance hold
// different tables (their own shapes and offsets) that declare the same
// fused parts (every rank of a MoE layer lists every expert's). The
// registry shares those lists too (ShareParts), before it interns the
// table.
//
// Entries are weak: a list lives as long as a participant holds it.
// Thread-safe.
#ifndef FERRY_DAEMON_REGISTRY_TABLE_INTERNER_H_
#define FERRY_DAEMON_REGISTRY_TABLE_INTERNER_H_

#include <cstdint>
#include <iterator>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "core/layout_resolution.h"
#include "core/model_spec.h"

namespace ferry {

using EngineParams = std::vector<EngineParam>;
using ParamSpecs = std::vector<ParamSpec>;
using PartsList = std::vector<FusedPart>;

// Digests of what the lists' equality compares. A table's digest takes
// each parts list's size and its first and last part, not every name: by
// then equal lists are shared (ShareParts) and compare by pointer, and the
// rest of the table tells tables apart.
uint64_t DigestOf(const EngineParams& params);
uint64_t DigestOf(const ParamSpecs& params);
uint64_t DigestOf(const PartsList& parts);
bool SameSpecs(const ParamSpecs& a, const ParamSpecs& b);

template <typename List>
class ListInterner {
 public:
  // An equal list already held, else `list` (now held). Null stays null.
  std::shared_ptr<const List> Intern(std::shared_ptr<const List> list)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Lists held now (expired entries not counted), for tests.
  size_t Live() const ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    size_t live = 0;
    for (const auto& entry : held_) live += !entry.second.expired();
    return live;
  }

 private:
  static bool Equal(const List& a, const List& b);

  mutable absl::Mutex mu_;
  std::unordered_multimap<uint64_t, std::weak_ptr<const List>> held_
      ABSL_GUARDED_BY(mu_);
  // The same entries by address, to find a list held already without
  // hashing it. An address may be reused after its list dies: the weak
  // pointer tells.
  std::unordered_map<const List*, std::weak_ptr<const List>> by_address_
      ABSL_GUARDED_BY(mu_);
  size_t interned_since_sweep_ ABSL_GUARDED_BY(mu_) = 0;
};

using TableInterner = ListInterner<EngineParams>;
using DeclarationInterner = ListInterner<ParamSpecs>;
using PartsInterner = ListInterner<PartsList>;

// `params` with each fused parameter's parts replaced by an equal list that
// `parts` holds (the lists it does not hold yet, it holds from now on).
// Returns `params` itself when every list was held already, else a copy:
// the table's own entries are few, its parts many (Kimi-K2 at TP 16: 1,400
// parameters, 138,000 parts per rank).
std::shared_ptr<const EngineParams> ShareParts(
    std::shared_ptr<const EngineParams> params, PartsInterner* parts);

template <>
inline bool ListInterner<EngineParams>::Equal(const EngineParams& a,
                                              const EngineParams& b) {
  return a == b;
}
template <>
inline bool ListInterner<ParamSpecs>::Equal(const ParamSpecs& a,
                                            const ParamSpecs& b) {
  return SameSpecs(a, b);
}
template <>
inline bool ListInterner<PartsList>::Equal(const PartsList& a,
                                           const PartsList& b) {
  return a == b;
}

template <typename List>
std::shared_ptr<const List> ListInterner<List>::Intern(
    std::shared_ptr<const List> list) {
  if (list == nullptr) return list;
  {
    // A list held already (a declaration the DeclarationCache gave again,
    // a parts list shared before): no need to hash it.
    absl::MutexLock lock(&mu_);
    auto it = by_address_.find(list.get());
    if (it != by_address_.end() && it->second.lock() == list) return list;
  }
  // Hashing and comparing run outside the lock: a list is up to hundreds
  // of thousands of parameters.
  const uint64_t digest = DigestOf(*list);
  std::vector<std::shared_ptr<const List>> candidates;
  {
    absl::MutexLock lock(&mu_);
    auto range = held_.equal_range(digest);
    for (auto it = range.first; it != range.second; ++it) {
      if (std::shared_ptr<const List> held = it->second.lock()) {
        candidates.push_back(std::move(held));
      }
    }
  }
  for (std::shared_ptr<const List>& held : candidates) {
    if (held == list || Equal(*held, *list)) return held;
  }
  absl::MutexLock lock(&mu_);
  // Two equal lists interned at once may both be held; either is right.
  held_.emplace(digest, list);
  by_address_[list.get()] = list;
  // Sweep dead entries once the maps have doubled since the last sweep:
  // amortized constant work per list.
  if (++interned_since_sweep_ > held_.size() / 2 + 256) {
    interned_since_sweep_ = 0;
    for (auto it = held_.begin(); it != held_.end();) {
      it = it->second.expired() ? held_.erase(it) : std::next(it);
    }
    for (auto it = by_address_.begin(); it != by_address_.end();) {
      it = it->second.expired() ? by_address_.erase(it) : std::next(it);
    }
  }
  return list;
}

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_TABLE_INTERNER_H_
