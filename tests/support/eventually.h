// Eventually: waits for a condition a test can observe (a state the daemon
// reports, a file, a flag another thread set) instead of sleeping for a
// guessed time. Polls, since most conditions are answers to RPCs.
#ifndef FERRY_TESTS_SUPPORT_EVENTUALLY_H_
#define FERRY_TESTS_SUPPORT_EVENTUALLY_H_

#include <functional>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace ferry {
namespace testing {

// Calls `done` every `poll` until it returns true or `timeout` has passed;
// whether it did. `done` is called once more at the deadline, so a
// condition that holds by then is never reported as timed out.
// `done` runs on the calling thread: it may use Catch2 (INFO, CHECK).
inline bool Eventually(const std::function<bool()>& done,
                       absl::Duration timeout,
                       absl::Duration poll = absl::Milliseconds(20)) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(poll);
  }
  return done();
}

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_SUPPORT_EVENTUALLY_H_
