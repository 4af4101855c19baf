// VerifyingEngine: a stand-in for one TP rank of a vLLM-style engine that
// checks every byte it receives. demo_engine and tests/client/e2e_test use
// it.
//
// It allocates the rank's live parameters (core/models BuildEngineTables:
// fused qkv_proj and gate_up_proj, vocab-parallel embeddings) in a
// SharedTensorArena filled with the base weights (version 0), and provides
// DestinationClient callbacks:
//   on_apply   checks every fallback tensor against the version's expected
//              bytes (weight_pattern.h), then "loads" it: copies this rank's
//              share into the live parameter, as vLLM's weight loader would;
//              a mismatch acks FAILED, so bad bytes never commit;
//   on_commit  checks every byte of every live parameter for the version.
// `force_fallback` flags the engine parameters whose names contain one of
// its substrings as transformed, so ferry routes them through staging.
//
// Where the bytes belong comes from resolving the tables *without* the
// forced flags (core ResolveDestinationLayout): those direct pieces are
// both what COMMIT checks and where the loader writes fallback tensors.
//
// Threading: callbacks run on the DestinationClient's reader thread; the
// counters are safe to read from any thread.
#ifndef FERRY_EXAMPLES_DEMO_VERIFYING_ENGINE_H_
#define FERRY_EXAMPLES_DEMO_VERIFYING_ENGINE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "client/destination_client.h"
#include "client/shared_tensor_arena.h"
#include "core/layout_resolution.h"
#include "core/models/model_schema.h"

namespace ferry {

class VerifyingEngine {
 public:
  // REQUIRES: `schema` outlives the engine.
  static absl::StatusOr<std::unique_ptr<VerifyingEngine>> Create(
      const ModelSchema& schema, int tp, int tp_rank,
      const std::vector<std::string>& force_fallback,
      const std::string& arena_hint);

  VerifyingEngine(const VerifyingEngine&) = delete;
  VerifyingEngine& operator=(const VerifyingEngine&) = delete;

  // The table to register (region 0 = arena), with the forced flags.
  const EngineTable& table() const { return table_; }
  SharedTensorArena& arena() { return *arena_; }
  int forced_fallback_params() const { return forced_; }
  // Bytes of live parameters COMMIT checks.
  int64_t checked_bytes() const { return checked_bytes_; }

  // Callbacks bound to this engine; it must outlive the client using them.
  DestinationCallbacks Callbacks();

  // Checks every live byte against version v. DATA_LOSS naming the first
  // mismatches.
  absl::Status VerifyLive(int64_t version) const;

  int64_t committed_version() const ABSL_LOCKS_EXCLUDED(mu_);
  int mismatches() const ABSL_LOCKS_EXCLUDED(mu_);
  int aborts() const ABSL_LOCKS_EXCLUDED(mu_);
  int fallback_tensors_loaded() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  VerifyingEngine(const ModelSchema& schema) : schema_(schema) {}
  absl::Status OnApply(int64_t v, const std::vector<FallbackTensorView>& tensors)
      ABSL_LOCKS_EXCLUDED(mu_);
  void OnCommit(int64_t v) ABSL_LOCKS_EXCLUDED(mu_);
  void OnAbort(int64_t v, const std::string& reason, bool dirty)
      ABSL_LOCKS_EXCLUDED(mu_);

  const ModelSchema& schema_;
  // Set in Create, read-only afterwards: read from any thread without mu_.
  EngineTable table_;
  std::vector<Piece> live_pieces_;  // into the arena (region 0)
  int forced_ = 0;
  int64_t checked_bytes_ = 0;
  std::unique_ptr<SharedTensorArena> arena_;

  mutable absl::Mutex mu_;
  int64_t committed_ ABSL_GUARDED_BY(mu_) = 0;
  int mismatches_ ABSL_GUARDED_BY(mu_) = 0;
  int aborts_ ABSL_GUARDED_BY(mu_) = 0;
  int fallback_loaded_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace ferry

#endif  // FERRY_EXAMPLES_DEMO_VERIFYING_ENGINE_H_
