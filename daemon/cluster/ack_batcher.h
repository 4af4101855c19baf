// AckBatcher: a member daemon's acks to the coordinator, batched. Each of
// its ranks' Ack calls waits here while one Versions.AckBatch call carries
// every ack that arrived meanwhile, and returns what the coordinator
// answered for its own ack.
//
// Why: a fleet's engine ranks ack each PREPARE, PAUSE and APPLY at nearly
// the same moment, and one forwarded call per ack cost the coordinator a
// gRPC call per rank per step (docs/benchmarks.md, "A fleet on one
// coordinator"). No timer: a batch goes as soon as none is in flight, so
// a lone ack waits for nothing, and acks that arrive during a call leave
// together in the next one.
//
// Threading: thread-safe; the caller whose ack finds no call in flight
// makes the call (for everyone queued), the others wait.
#ifndef FERRY_DAEMON_CLUSTER_ACK_BATCHER_H_
#define FERRY_DAEMON_CLUSTER_ACK_BATCHER_H_

#include <chrono>
#include <deque>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "proto/ferry/v1/version.grpc.pb.h"

namespace ferry {

class AckBatcher {
 public:
  // `stub`: the coordinator's Versions service (not owned).
  explicit AckBatcher(v1::Versions::Stub* stub) : stub_(stub) {}

  // The coordinator's answer to `ack`, as Versions.Ack gives it; the
  // call's own error (UNAVAILABLE, ...) when the batch could not be sent.
  absl::Status Ack(const v1::AckRequest& ack,
                   std::chrono::system_clock::time_point deadline)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Pending {
    const v1::AckRequest* ack = nullptr;
    std::chrono::system_clock::time_point deadline;
    absl::Status result;
    bool done = false;
  };
  // Sends `batch` as one AckBatch call; fills each result.
  void Send(const std::deque<Pending*>& batch);

  v1::Versions::Stub* const stub_;
  absl::Mutex mu_;
  std::deque<Pending*> queue_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_ACK_BATCHER_H_
