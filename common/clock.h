// Clock: where leases and deadlines read the time.
//
// ferryd's leases (Registry), ack and version deadlines (VersionCoordinator)
// compare against Clock::Now() instead of absl::Now(), so a test can hold
// time still and move it on: a lease of a minute expires in the test the
// moment the test advances a ManualClock past it, without sleeping. The
// threads that look at deadlines (the reaper, the deadline thread) still
// wake on real time, every few tens of milliseconds, and then read the
// clock; so after ManualClock::Advance a test waits at most one such period
// for the effect.
//
// Durations of what happened (a version's begin-to-commit, progress) stay
// on real time: they are measurements, not decisions.
//
// Threading: Now() and Advance() from any thread.
#ifndef FERRY_COMMON_CLOCK_H_
#define FERRY_COMMON_CLOCK_H_

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ferry {

class Clock {
 public:
  virtual ~Clock() = default;
  virtual absl::Time Now() const = 0;

  // absl::Now(); never destroyed.
  static Clock* Real();
};

// A clock that moves only when told to; starts at `start`.
class ManualClock : public Clock {
 public:
  explicit ManualClock(absl::Time start = absl::UnixEpoch() + absl::Hours(24));

  absl::Time Now() const override ABSL_LOCKS_EXCLUDED(mu_);
  void Advance(absl::Duration d) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_COMMON_CLOCK_H_
