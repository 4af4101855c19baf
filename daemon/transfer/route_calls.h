// RouteCalls: the Peer.RunTransfer calls one transfer asks of other nodes
// (each sends its part of the instance, or copies it on its own node), all
// in flight at once on gRPC's callback API and waited for together on the
// caller's thread.
//
// Why not a thread per call: a fleet's coordinator asks every node that
// holds trainer ranks for its part of every instance, 1,536 calls per
// version at 1,024 ranks. A thread started per call, each polling for a
// cancel, cost the coordinator more CPU (thread stacks, TLS, wakeups)
// than the calls themselves (docs/benchmarks.md, "A fleet on one
// coordinator").
//
// Owner: the transfer that started the calls (RouteSender::RunRoutes); it
// must outlive Wait. Threading: Start and Wait on the owner's thread;
// `on_done` runs on a gRPC thread, once per call, and must not block.
#ifndef FERRY_DAEMON_TRANSFER_ROUTE_CALLS_H_
#define FERRY_DAEMON_TRANSFER_ROUTE_CALLS_H_

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/peer.grpc.pb.h"

namespace ferry {

class RouteCalls {
 public:
  // A call's outcome: its index as given to Start, node `node`'s answer
  // (a gRPC status as an absl::Status naming the node), and its response.
  using OnDone = std::function<void(size_t index, absl::Status status,
                                    v1::RunTransferResponse& response)>;

  explicit RouteCalls(OnDone on_done) : on_done_(std::move(on_done)) {}
  RouteCalls(const RouteCalls&) = delete;
  RouteCalls& operator=(const RouteCalls&) = delete;
  // Waits for calls still in flight (a caller that returned early).
  ~RouteCalls();

  // Sends `request` (not copied: it must outlive Wait) to `node` over
  // `channel`, answered by `deadline`.
  void Start(size_t index, const std::string& node,
             const std::shared_ptr<grpc::Channel>& channel,
             const v1::RunTransferRequest* request, absl::Time deadline);

  // Returns once every call started has been answered. When `give_up`
  // turns true (another route failed, the version was cancelled), the
  // calls still in flight are cancelled and end CANCELLED.
  void Wait(const std::function<bool()>& give_up);

 private:
  struct Call {
    size_t index = 0;
    std::string node;
    std::unique_ptr<v1::Peer::Stub> stub;
    grpc::ClientContext context;
    v1::RunTransferResponse response;
  };
  // How many calls were answered. Shared with each call's callback, which
  // counts its own answer last and may still be unlocking when Wait
  // returns and the RouteCalls goes.
  struct Answered {
    absl::Mutex mu;
    size_t count ABSL_GUARDED_BY(mu) = 0;
  };

  const OnDone on_done_;
  std::vector<std::unique_ptr<Call>> calls_;  // the owner's thread only
  const std::shared_ptr<Answered> answered_ = std::make_shared<Answered>();
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_ROUTE_CALLS_H_
