// DeclarationCache: trainer ranks' model declarations, parsed, validated
// and indexed once.
//
// Every rank of a trainer declares the whole model (Kimi-K2: 139,583
// parameters), and parsing, indexing and validating one declaration took
// about 100 ms on the development VM: 25-30 s of the coordinator's CPU
// while 256 ranks registered (docs/benchmarks.md). A declaration equal,
// field by field, to one parsed before is that one: the comparison
// allocates nothing. Equal to a validated list, it is valid.
//
// Entries are weak, as in the registry's interners: a parsed declaration
// lives as long as a participant holds its list, and the cache keeps the
// last few alive ones. Owner: the Registry (every registration path
// reaches it). Threading: thread-safe; comparing and parsing run outside
// the lock.
#ifndef FERRY_DAEMON_REGISTRY_DECLARATION_CACHE_H_
#define FERRY_DAEMON_REGISTRY_DECLARATION_CACHE_H_

#include <cstddef>
#include <deque>
#include <memory>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "core/model_spec.h"
#include "proto/ferry/v1/types.pb.h"
#include "proto/registration_convert.h"

namespace ferry {

// DeclaredParameters and DeclarationFromProto (convert, index and validate
// one declaration, no cache) are proto/registration_convert.h's.

// Whether `params` declares exactly `spec`'s parameters, in its order.
bool DeclaresExactly(const DeclaredParameters& params, const ModelSpec& spec);

class DeclarationCache {
 public:
  // Holds at most `capacity` declarations (the most recently used).
  explicit DeclarationCache(size_t capacity = 8) : capacity_(capacity) {}
  DeclarationCache(const DeclarationCache&) = delete;
  DeclarationCache& operator=(const DeclarationCache&) = delete;

  // A held declaration equal to `params`, else DeclarationFromProto's
  // (then held when it is valid). A registration's conversion step calls
  // it (registration_parser.h).
  absl::StatusOr<std::shared_ptr<const ModelSpec>> Parse(
      const DeclaredParameters& params, absl::string_view who)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Declarations found held, and parsed, since construction (for tests).
  size_t hits() const ABSL_LOCKS_EXCLUDED(mu_);
  size_t parsed() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const size_t capacity_;
  mutable absl::Mutex mu_;
  std::deque<std::weak_ptr<const ModelSpec>> held_ ABSL_GUARDED_BY(mu_);
  size_t hits_ ABSL_GUARDED_BY(mu_) = 0;
  size_t parsed_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_DECLARATION_CACHE_H_
