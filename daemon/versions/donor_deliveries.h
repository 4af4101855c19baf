// DonorDeliveries: an instance filled with its stream's latest committed
// version from a donor instance that holds it, never from the trainer
// (version_run.h, "Donor deliveries"): the bootstrap of a late instance,
// started by the delivery thread, and Lifecycle.ReloadInPlace. Also the
// choice of a donor (an onload's refill asks for one too) and what
// ListStreams shows of a delivery (v1::PeerDelivery).
//
// Each delivery is a one-instance run of the version state machine in the
// stream's delivery slot, with the donor's ranks as its sources
// (donor_plan.h), driven through RunDriver (run_driver.h), which the
// coordinator implements.
//
// Owner: VersionCoordinator (version_coordinator.h), which tells it which
// streams may want a bootstrap (a rank registered, an instance swapped, a
// run settled); callers reach ReloadInPlace as its deliveries().
// Threading: no lock of its own. It runs under the coordinator's (`mu`,
// given at construction), as the TransferQueue does (transfer_queue.h):
// the coordinator says so with AssertHeld before each ...Locked call.
// Thread of its own: the delivery thread (Start, StopLocked, Join), which
// plans bootstraps without the lock and starts them under it.
#ifndef FERRY_DAEMON_VERSIONS_DONOR_DELIVERIES_H_
#define FERRY_DAEMON_VERSIONS_DONOR_DELIVERIES_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/versions/run_driver.h"
#include "daemon/versions/version_run.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

class DonorDeliveries {
 public:
  using Expired = std::function<bool()>;

  // `mu` and `changed` are the coordinator's lock and CondVar, `driver`
  // the coordinator; all outlive this. `plans` is not owned.
  DonorDeliveries(absl::Mutex& mu, absl::CondVar& changed, RunDriver* driver,
                  PlanCache* plans);
  ~DonorDeliveries();
  DonorDeliveries(const DonorDeliveries&) = delete;
  DonorDeliveries& operator=(const DonorDeliveries&) = delete;

  // Starts the delivery thread.
  void Start();
  // The thread exits at its next wake (the coordinator signals).
  void StopLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Joins it; after StopLocked, without the lock.
  void Join() ABSL_LOCKS_EXCLUDED(mu_);
  // Tells clang that the caller's lock is this one's (they are one).
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK(mu_) {
    mu_.AssertHeld();
  }

  // Lifecycle.ReloadInPlace: writes the stream's latest committed version
  // into the instance's registered buffers again, from a donor instance that
  // holds it, and returns the instance's status once the delivery settled
  // (COMMITTED, or ABORTED with the reason). NOT_FOUND: the instance is not
  // planned on `stream`; FAILED_PRECONDITION: a version or another delivery
  // is in progress on the stream (named), the stream has no committed
  // version, or no instance holding it can serve as a donor (why, for each).
  absl::StatusOr<v1::InstanceStatus> ReloadInPlace(
      const std::string& stream, const std::string& instance_id,
      const Expired& expired) ABSL_LOCKS_EXCLUDED(mu_);

  // REQUIRES: mu_ held, for every *Locked method.
  // A donor for `target` (index into sp.instances) at `version`: the index
  // of an instance that holds it clean and may serve, preferring one of the
  // same TP size; else -1 with `why` listing why each candidate cannot.
  int32_t ChooseDonorLocked(const StreamPlan& sp, int32_t target,
                            int64_t version, std::string* why) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A delivery as ListStreams shows it.
  v1::PeerDelivery InfoLocked(const VersionRun& run) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The stream's instances may need a bootstrap (a rank registered, an
  // instance swapped onto it): the delivery thread looks at it.
  void WantLocked(const std::string& stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // A run of the stream settled: a bootstrap that had to wait for it may
  // start now.
  void RunSettledLocked(const std::string& stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Whether the delivery thread has yet to look at the stream, or looks at
  // it now (WaitForFill waits for it).
  bool PendingLocked(const std::string& stream) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

 private:
  // Why a donor delivery cannot start on the stream now ("" when it can):
  // nothing committed to deliver yet, or the busy rule.
  std::string DeliveryBlockedLocked(const std::string& stream) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts a donor delivery of `plan` (donor_plan.h) at `version`.
  std::shared_ptr<VersionRun> StartDeliveryLocked(
      std::shared_ptr<const StreamPlan> plan, RunKind kind,
      const std::string& donor, int64_t version)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Starts the bootstraps the stream's plan calls for, if it can.
  void BootstrapStream(const std::string& stream) ABSL_LOCKS_EXCLUDED(mu_);
  void DeliveryLoop() ABSL_LOCKS_EXCLUDED(mu_);

  absl::Mutex& mu_;          // the coordinator's
  absl::CondVar& changed_;   // the coordinator's
  RunDriver* const driver_;  // the coordinator
  PlanCache* const plans_;

  // Streams whose instances may need a bootstrap (a rank registered, a run
  // settled): the delivery thread looks at them.
  std::set<std::string> bootstrap_wanted_ ABSL_GUARDED_BY(mu_);
  // Streams whose bootstrap check found a run in the way: looked at again
  // when a run of theirs settles.
  std::set<std::string> bootstrap_deferred_ ABSL_GUARDED_BY(mu_);
  // Streams the delivery thread took from bootstrap_wanted_ and is looking
  // at now (WaitForFill waits for them).
  std::set<std::string> bootstrap_checking_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;  // the thread exits
  std::thread thread_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_DONOR_DELIVERIES_H_
