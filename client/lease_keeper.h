// LeaseKeeper: renews a participant's lease on a background thread.
//
// A registration returns a lease (docs/api.md, "Leases"); a lease that runs
// out is a Deregister done by the daemon. SourceClient and DestinationClient
// each own one LeaseKeeper, which sends Heartbeat every lease / 3 (the
// daemon's answer may change the lease; the period follows it). A failed
// heartbeat is retried at the next tick; NOT_FOUND (the lease already ran
// out) or PERMISSION_DENIED stop the thread for good, are kept for
// status(), and call `on_lost` (if given) from the thread, once.
//
// Threading: one thread of its own; status() is thread-safe. The destructor
// stops the thread and joins it, waiting at most one RPC deadline.
#ifndef FERRY_CLIENT_LEASE_KEEPER_H_
#define FERRY_CLIENT_LEASE_KEEPER_H_

#include <functional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

class LeaseKeeper {
 public:
  // Starts the thread. `who` names the participant in logs ("source policy
  // rank 3"). REQUIRES: lease > 0.
  LeaseKeeper(Connection connection, v1::ParticipantHandle handle,
              absl::Duration lease, std::string who,
              std::function<void()> on_lost = nullptr);
  ~LeaseKeeper();
  LeaseKeeper(const LeaseKeeper&) = delete;
  LeaseKeeper& operator=(const LeaseKeeper&) = delete;

  // OK while the lease is held; the error that ended it otherwise.
  absl::Status status() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Run() ABSL_LOCKS_EXCLUDED(mu_);

  const Connection connection_;
  const v1::ParticipantHandle handle_;
  const std::string who_;
  const std::function<void()> on_lost_;  // must not destroy this keeper
  mutable absl::Mutex mu_;
  absl::Duration lease_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;  // started last in the constructor
};

}  // namespace ferry

#endif  // FERRY_CLIENT_LEASE_KEEPER_H_
