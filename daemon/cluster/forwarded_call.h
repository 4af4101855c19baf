// A client's call as a member daemon relays it to the coordinator
// (forwarding.h): the caller's deadline carried upstream, a batch call's
// answers split back into each caller's, and a callback call relayed with
// no thread waiting for the answer (Forwarded).
//
// Threading: Forwarded runs its callbacks on gRPC's threads; the rest are
// pure.
#ifndef FERRY_DAEMON_CLUSTER_FORWARDED_CALL_H_
#define FERRY_DAEMON_CLUSTER_FORWARDED_CALL_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc_status.h"

namespace ferry {

// A client context for a forwarded call: the caller's deadline.
void Prepare(const grpc::ServerContextBase* server,
             grpc::ClientContext* client);

// A caller's deadline, or 30 s from now when it set none (a batch must
// end).
std::chrono::system_clock::time_point DeadlineOf(
    const grpc::ServerContextBase* server);

// An outcome of a batch call as the status its own call would have had.
template <typename Outcome>
absl::Status StatusOf(const Outcome& o) {
  return o.code() == 0 ? absl::OkStatus()
                       : absl::Status(static_cast<absl::StatusCode>(o.code()),
                                      o.message());
}

// The coordinator's answers to a batch: one per request, or the call's
// error (or a short answer) for all of them.
template <typename Response, typename BatchResponse, typename Each>
std::vector<absl::StatusOr<Response>> Answers(const grpc::Status& call,
                                              const BatchResponse& response,
                                              size_t asked, Each each) {
  absl::Status all = FromGrpcStatus(call);
  if (all.ok() && static_cast<size_t>(response.outcomes_size()) != asked) {
    all = absl::InternalError(absl::StrCat(
        "the coordinator answered ", response.outcomes_size(),
        " of a batch of ", asked));
  }
  std::vector<absl::StatusOr<Response>> answers;
  for (size_t i = 0; i < asked; ++i) {
    if (!all.ok()) {
      answers.emplace_back(all);
      continue;
    }
    answers.push_back(each(response.outcomes(static_cast<int>(i))));
  }
  return answers;
}

// A sync call relayed upstream on the handler's thread.
template <typename Stub, typename Req, typename Resp, typename Method>
grpc::Status ForwardCall(grpc::ServerContext* server, Stub* stub, Method method,
                         const Req* request, Resp* response) {
  grpc::ClientContext client;
  Prepare(server, &client);
  return (stub->*method)(&client, *request, response);
}

// A call relayed upstream with no thread waiting for the answer:
// CommitVersion, whose answer comes when the version settles (a member
// holds tens of trainer ranks that commit at once), and BeginVersion.
// `start` begins the upstream call on the stub's callback API. The client
// cancelling cancels the upstream call. Owner: itself; deleted once both
// calls are done.
class Forwarded final : public grpc::ServerUnaryReactor {
 public:
  using Start = std::function<void(grpc::ClientContext*,
                                   std::function<void(grpc::Status)>)>;
  Forwarded(grpc::CallbackServerContext* server, const Start& start);
  void OnCancel() override { upstream_.TryCancel(); }
  void OnDone() override { Unref(); }

 private:
  ~Forwarded() override = default;
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }
  grpc::ClientContext upstream_;
  std::atomic<int> refs_{2};  // the upstream call and the client's
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_FORWARDED_CALL_H_
