// SubscriptionRelay: a member daemon's Versions.Subscribe streams, those of
// every rank on its node, carried to the coordinator on one
// Versions.SubscribeRelay call. Each rank's Subscribe here is a LocalStream
// with an id of this relay's; the relay opens it upstream under that id,
// hands each event the coordinator sends to its stream, and ends the
// stream with the end the coordinator sends for it.
//
// Why one call, not one per rank: a rank's own upstream stream cost the
// coordinator a gRPC message per event per rank, and this member a stream
// relayed per rank (docs/benchmarks.md, "A fleet on one coordinator").
//
// When the upstream call ends (the coordinator restarted or is
// unreachable, or this daemon stops), every stream on it ends UNAVAILABLE
// and its client subscribes again, which starts a new call. Each
// LocalStream writes its own events one at a time from its own queue, so a
// slow client slows only itself.
//
// Locking: mu_ guards the upstream call and the streams on it; a
// LocalStream's own mu_ is a leaf. No gRPC operation is started with
// either held (a reaction may run inline and take them).
//
// Owner: the ForwardingVersionsService. Its destructor cancels the
// upstream call and waits for it to end.
#ifndef FERRY_DAEMON_CLUSTER_SUBSCRIPTION_RELAY_H_
#define FERRY_DAEMON_CLUSTER_SUBSCRIPTION_RELAY_H_

#include <atomic>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/version.grpc.pb.h"

namespace ferry {

class SubscriptionRelay {
 public:
  // `stub`: the coordinator's Versions service (not owned; outlives this).
  explicit SubscriptionRelay(v1::Versions::Stub* stub) : stub_(stub) {}
  ~SubscriptionRelay() ABSL_LOCKS_EXCLUDED(mu_);
  SubscriptionRelay(const SubscriptionRelay&) = delete;
  SubscriptionRelay& operator=(const SubscriptionRelay&) = delete;

  // A rank's Subscribe on this member: the reactor gRPC runs for it.
  grpc::ServerWriteReactor<v1::UpdateEvent>* Subscribe(
      const v1::SubscribeRequest& request) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  class Upstream;
  class LocalStream;

  // The stream `id` on `up` went away: closed upstream.
  void Close(Upstream* up, uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  // Starts a write of what `up` has queued, if none is in flight.
  void Flush(Upstream* up) ABSL_LOCKS_EXCLUDED(mu_);
  // What the coordinator sent on `up`: events and ends to the streams.
  void Deliver(Upstream* up, const v1::SubscribeRelayResponse& response)
      ABSL_LOCKS_EXCLUDED(mu_);
  // `up` ended with `status`: its streams end UNAVAILABLE.
  void Ended(Upstream* up, const grpc::Status& status)
      ABSL_LOCKS_EXCLUDED(mu_);

  v1::Versions::Stub* const stub_;
  absl::Mutex mu_;
  Upstream* upstream_ ABSL_GUARDED_BY(mu_) = nullptr;  // the live call
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  int calls_ ABSL_GUARDED_BY(mu_) = 0;  // upstream calls not yet done
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_SUBSCRIPTION_RELAY_H_
