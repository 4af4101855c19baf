// ForwardedSubscribe: a member's Versions.Subscribe, relayed to the
// coordinator's as a pair of gRPC callback streams: the client's call here
// and this daemon's call upstream. No thread waits on either; each event
// read upstream is written to the client before the next is read, so a
// slow client slows only its own stream.
//
// Why not a thread per stream: a member of a fleet holds tens of engine
// ranks, and two threads per rank (one reading upstream, one watching for
// the client's cancel) each woke every 50 ms (docs/benchmarks.md, "A fleet
// on one coordinator").
//
// Ends with the upstream call's status; the client going away or
// cancelling cancels the upstream call. Owner: itself; deleted once both
// calls are done.
#ifndef FERRY_DAEMON_CLUSTER_FORWARDED_SUBSCRIBE_H_
#define FERRY_DAEMON_CLUSTER_FORWARDED_SUBSCRIBE_H_

#include <atomic>
#include <optional>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/version.grpc.pb.h"

namespace ferry {

class ForwardedSubscribe final
    : public grpc::ServerWriteReactor<v1::UpdateEvent> {
 public:
  // Starts the upstream call on `stub` (not owned; outlives the call).
  ForwardedSubscribe(grpc::CallbackServerContext* context,
                     v1::Versions::Stub* stub,
                     const v1::SubscribeRequest& request);

  // The client's side.
  void OnWriteDone(bool ok) override;
  void OnCancel() override;
  void OnDone() override;

 private:
  // The upstream side.
  class Upstream final : public grpc::ClientReadReactor<v1::UpdateEvent> {
   public:
    explicit Upstream(ForwardedSubscribe* owner) : owner_(owner) {}
    void OnReadDone(bool ok) override;
    void OnDone(const grpc::Status& status) override;

   private:
    ForwardedSubscribe* const owner_;
  };

  ~ForwardedSubscribe() override = default;
  // Finishes the client's call with `status` unless a write is in flight
  // (then OnWriteDone does).
  void FinishClient(const grpc::Status& status) ABSL_LOCKS_EXCLUDED(mu_);
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  grpc::ClientContext upstream_context_;
  v1::SubscribeRequest request_;
  Upstream upstream_{this};
  v1::UpdateEvent event_;  // read upstream, written to the client
  std::atomic<int> refs_{2};  // the client's call and the upstream call

  absl::Mutex mu_;
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> finish_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_FORWARDED_SUBSCRIBE_H_
