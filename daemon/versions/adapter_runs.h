// AdapterRuns: what the version protocol does for a LoRA adapter
// (adapters.h; the adapter's ranks are destinations of the adapter stream)
// beyond the ordinary protocol on its own instance (versions of its stream,
// its bootstrap from a donor): waiting for a newly attached adapter's first
// fill, and the unload run (UNLOAD_ADAPTER to every rank, a one-instance
// run in the stream's delivery slot, driven through RunDriver,
// run_driver.h).
//
// Owner: VersionCoordinator (version_coordinator.h); callers reach it as
// its adapters() (adapters.cc). Threading: no lock of its own;
// each call takes the coordinator's (`mu`, given at construction) and
// waits on its CondVar.
#ifndef FERRY_DAEMON_VERSIONS_ADAPTER_RUNS_H_
#define FERRY_DAEMON_VERSIONS_ADAPTER_RUNS_H_

#include <functional>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/versions/run_driver.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

class AdapterRuns {
 public:
  using Expired = std::function<bool()>;

  // `mu` and `changed` are the coordinator's lock and CondVar, `driver`
  // the coordinator; all outlive this. `plans` is not owned;
  // `version_timeout` bounds an unload's wait for the delivery slot
  // (VersionCoordinatorOptions::version_timeout).
  AdapterRuns(absl::Mutex& mu, absl::CondVar& changed, RunDriver* driver,
              PlanCache* plans, absl::Duration version_timeout);
  AdapterRuns(const AdapterRuns&) = delete;
  AdapterRuns& operator=(const AdapterRuns&) = delete;

  // Waits until the adapter instance `instance_id` holds `stream`'s latest
  // committed version (its bootstrap from a donor instance settled) or
  // cannot get it now (nothing committed yet, or no donor holds it: it
  // waits for the stream's next version), for at most `timeout`; returns
  // its status then (waiting_reason says what it waits for).
  v1::InstanceStatus WaitForFill(const std::string& stream,
                                 const std::string& instance_id,
                                 absl::Duration timeout,
                                 const Expired& expired)
      ABSL_LOCKS_EXCLUDED(mu_);
  // UNLOAD_ADAPTER to every rank of the adapter instance, in the stream's
  // delivery slot (after the version or delivery in progress settles,
  // within the version timeout), until each acked. OK, or why not
  // (ABORTED naming the rank that failed or was late, NOT_FOUND when the
  // instance is not complete, DEADLINE_EXCEEDED when the slot stayed
  // busy).
  absl::Status UnloadAdapter(const std::string& stream,
                             const std::string& instance_id,
                             const Expired& expired) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  absl::Mutex& mu_;          // the coordinator's
  absl::CondVar& changed_;   // the coordinator's
  RunDriver* const driver_;  // the coordinator
  PlanCache* const plans_;
  const absl::Duration version_timeout_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_ADAPTER_RUNS_H_
