#include "daemon/transfer/route_calls.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"

namespace ferry {

namespace {

// How often Wait looks at `give_up` while calls are in flight. One waiting
// thread per transfer, not per call.
constexpr absl::Duration kGiveUpPoll = absl::Milliseconds(20);

}  // namespace

RouteCalls::~RouteCalls() {
  // The calls reference their Call; none may outlive it.
  Wait([] { return true; });
}

void RouteCalls::Start(size_t index, const std::string& node,
                       const std::shared_ptr<grpc::Channel>& channel,
                       const v1::RunTransferRequest* request,
                       absl::Time deadline) {
  calls_.push_back(std::make_unique<Call>());
  Call* call = calls_.back().get();
  call->index = index;
  call->node = node;
  call->context.set_deadline(absl::ToChronoTime(deadline));
  call->stub = v1::Peer::NewStub(channel);
  call->stub->async()->RunTransfer(
      &call->context, request, &call->response,
      [this, call, answered = answered_](grpc::Status s) {
        on_done_(call->index,
                 FromGrpcStatus(s, absl::StrCat("node ", call->node,
                                                " RunTransfer")),
                 call->response);
        // Last: once counted, this RouteCalls may be gone.
        absl::MutexLock lock(&answered->mu);
        ++answered->count;
      });
}

void RouteCalls::Wait(const std::function<bool()>& give_up) {
  bool cancelled = false;
  for (;;) {
    {
      Answered& a = *answered_;
      absl::MutexLock lock(&a.mu);
      const size_t started = calls_.size();
      auto all_answered = [&a, started]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(a.mu) {
        return a.count == started;
      };
      if (a.mu.AwaitWithTimeout(absl::Condition(&all_answered), kGiveUpPoll)) {
        return;
      }
    }
    // Outside the lock: a cancel may finish a call on this thread.
    if (!cancelled && give_up()) {
      for (const std::unique_ptr<Call>& c : calls_) c->context.TryCancel();
      cancelled = true;
    }
  }
}

}  // namespace ferry
