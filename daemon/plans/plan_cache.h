// PlanCache: the Plan of each stream for its current membership.
//
// Role: when a stream's membership changes (the Registry's epoch moves), the
// next Get builds the stream's model (the union of its sources'
// declarations, sorted by name so that every daemon numbers parameters
// alike), resolves each complete instance's engine tables with
// ResolveDestinationLayout (explicit pieces are taken as they are; tables
// the plan before resolved under the same model are not resolved again),
// and plans with core's SourcePlanner: `plan`, with relays between
// replicas (what ExplainPlan shows, and what the executor follows while
// the replica an instance relays from is ready). When that replica failed, the
// instance reads the sources instead (DirectPlan), so one failing instance
// never holds up another: those copies are planned on first need, per
// instance, not with every membership, and are usually the copies of the
// root of its relay tree, shared (SourcePlanner::ReadAlike).
//
// An instance whose layout is invalid gets an `error` and is left out of
// the plans; the others are planned without it. Sources that are incomplete
// or do not tile the model give the whole stream a `source_error`.
//
// Owner: the Server. Threading: thread-safe; plans are built outside the
// lock and shared as shared_ptr<const StreamPlan>, immutable once built
// but for DirectPlan's copies, each filled once (absl::call_once).
#ifndef FERRY_DAEMON_PLANS_PLAN_CACHE_H_
#define FERRY_DAEMON_PLANS_PLAN_CACHE_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/call_once.h"
#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/exchange.h"
#include "core/layout_resolution.h"
#include "core/plan.h"
#include "core/planner.h"
#include "core/relay_choice.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/plans/fp8_quantizer.h"
#include "daemon/registry/registry.h"
#include "transport/device_memory.h"

namespace ferry {

// One complete instance of a stream, as planned.
struct PlannedInstance {
  std::string id;
  std::vector<std::shared_ptr<const Participant>> ranks;  // by tp rank
  // Ranks' pieces in core form (buffers: dense MemoryMap indices, or
  // kStagingBufferBit | k for the rank's k-th fallback tensor).
  std::shared_ptr<const std::vector<RankLayout>> layout;
  // Engine-table instances: the resolution (decisions, fallback tensors).
  // Its ranks' `layout` is empty: the pieces moved to `layout` above.
  std::shared_ptr<const ResolvedInstance> resolved;
  LoadOptions options;      // as the Registry holds them
  std::string error;        // non-empty: not planned, why
  int32_t plan_index = -1;  // index into StreamPlan::plan.instances
};

// Whether the instance is an adapter attachment being replaced or
// unloaded (adapters.h): it takes part in no new version or bootstrap.
bool RetiringAdapter(const PlannedInstance& instance);

struct StreamPlan {
  std::string stream;
  uint64_t epoch = 0;
  ModelSpec model;
  std::vector<std::shared_ptr<const Participant>> sources;  // by rank
  std::vector<RankLayout> source_layouts;  // by rank, model indices
  std::string source_error;  // non-empty: no plan at all, why
  std::vector<PlannedInstance> instances;  // complete instances, by id
  Plan plan;  // with relays
  // By plan index: the instances as the planner took them, and where
  // ferryd runs each one's relay (core/relay_choice.h).
  std::vector<Instance> planner_instances;
  std::vector<RelayWhere> relay_where;
  // By plan index, when the daemon runs with --exchange and some pair of
  // replicas exchanges (core/exchange.h); empty otherwise. Chosen over
  // what each instance reads from the sources where its relay does not
  // run (RelayRuns below, the coordinator on none of its nodes).
  std::vector<Exchange> exchanges;
  // The exchange of the instance at plan index `plan_index`; null when it
  // has none.
  const Exchange* ExchangeOf(int32_t plan_index) const;

  // Whether the coordinator on `node` relays instances[instance] from the
  // replica its plan names, once that one landed
  // (daemon/versions/transfer_queue.cc): as relay_where says (an empty `node`:
  // every rank is on the coordinator's), and never for an instance with an
  // exchange. The others read the sources, and do not wait.
  bool RelayRuns(int32_t instance, const std::string& node) const;

  // Instance `plan_index`'s copies when it reads the sources: its copies
  // in `plan` when it reads them there; for a relayed replica, planned on
  // first use from the sources (SourcePlanner::PlanAlone) and kept, or,
  // when it reads alike with the root of its relay tree (the usual case:
  // replicas on nodes without sources), that root's copies, shared
  // (PlanAlike). Every daemon computes the same. Thread-safe.
  const InstancePlan& DirectPlan(int32_t plan_index) const;

  // What DirectPlan plans relayed replicas with; set only when some
  // instance relays. It reads `model` and `source_layouts` above.
  std::unique_ptr<const SourcePlanner> source_planner;
  struct DirectSlot {
    absl::once_flag once;
    InstancePlan plan;
  };
  std::unique_ptr<DirectSlot[]> direct_slots;  // by plan index

  // FP8 in flight: set when some instance has quantized targets. Its
  // quantizer ranks are the last of `sources` / `source_layouts`, and
  // `model` ends with the derived parameters (core/fp8_sources.h); the
  // transfers of a version run it (Quantize) before they read those.
  std::shared_ptr<Fp8Quantizer> fp8;
  // The trainer's ranks: `sources` but the quantizer ranks (the ranks
  // that begin and commit versions).
  int32_t trainer_ranks() const {
    return static_cast<int32_t>(sources.size()) -
           (fp8 == nullptr ? 0 : static_cast<int32_t>(fp8->ranks().size()));
  }

  // Index into `instances`, or -1.
  int32_t FindInstance(const std::string& id) const;
  // Index into `instances` of the instance at plan index `plan_index`.
  int32_t InstanceAtPlanIndex(int32_t plan_index) const;
};

// How a daemon plans its streams.
struct PlanCacheOptions {
  // Pairs of replicas exchange the busiest senders' buckets
  // (core/exchange.h; ferryd's --exchange).
  bool exchange = false;
  // Largest bucket (PlanOptions::bucket_bytes).
  int64_t bucket_bytes = int64_t{64} << 20;
  // This daemon's node: where FP8 in flight can quantize (its trainer
  // ranks' memory is mapped here).
  std::string node;
  // Its GPUs (not owned; null: none): FP8 in flight reads a GPU trainer's
  // pieces through them.
  DeviceMemory* devices = nullptr;
};

class PlanCache {
 public:
  // `metrics` (not owned; null: none) counts hits and misses.
  explicit PlanCache(const Registry* registry, DaemonMetrics* metrics = nullptr,
                     PlanCacheOptions options = PlanCacheOptions())
      : registry_(registry), metrics_(metrics), options_(options) {}
  PlanCache(const PlanCache&) = delete;
  PlanCache& operator=(const PlanCache&) = delete;

  // The plan for the stream's current membership. NOT_FOUND for an unknown
  // stream. Planning failures are inside the StreamPlan, not errors.
  absl::StatusOr<std::shared_ptr<const StreamPlan>> Get(
      const std::string& stream) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const Registry* const registry_;
  DaemonMetrics* const metrics_;
  const PlanCacheOptions options_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const StreamPlan>> cache_
      ABSL_GUARDED_BY(mu_);
};

// Whether sp.instances[instance] resolves under `format`: OK, or the
// status ResolveDestinationLayout gives (kDirectOnly names the parameter
// that would fall back); FAILED_PRECONDITION for kFallbackOnly on an
// instance that registers explicit pieces (no loader to fall back to).
absl::Status CheckLoadFormat(const StreamPlan& sp, int32_t instance,
                             LoadFormat format);

// Builds a plan from a snapshot; exposed for tests. `previous` (null: none)
// is the stream's plan before: when the model is the same, its instances'
// resolutions serve instances with the same tables and load format again
// (a membership change re-resolves only the tables it brings).
std::shared_ptr<const StreamPlan> BuildStreamPlan(
    const Registry::StreamSnapshot& snapshot,
    const StreamPlan* previous = nullptr,
    const PlanCacheOptions& options = PlanCacheOptions());

}  // namespace ferry

#endif  // FERRY_DAEMON_PLANS_PLAN_CACHE_H_
