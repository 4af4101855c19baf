#include "daemon/cluster/forwarded_subscribe.h"

#include <chrono>

namespace ferry {

ForwardedSubscribe::ForwardedSubscribe(grpc::CallbackServerContext* context,
                                       v1::Versions::Stub* stub,
                                       const v1::SubscribeRequest& request)
    : request_(request) {
  if (context->deadline() != std::chrono::system_clock::time_point::max()) {
    upstream_context_.set_deadline(context->deadline());
  }
  stub->async()->Subscribe(&upstream_context_, &request_, &upstream_);
  upstream_.StartRead(&event_);
  upstream_.StartCall();
}

void ForwardedSubscribe::Upstream::OnReadDone(bool ok) {
  if (!ok) return;  // the upstream call ends: OnDone has its status
  {
    absl::MutexLock lock(&owner_->mu_);
    owner_->writing_ = true;
  }
  owner_->StartWrite(&owner_->event_);
}

void ForwardedSubscribe::Upstream::OnDone(const grpc::Status& status) {
  owner_->FinishClient(status);
  owner_->Unref();
}

void ForwardedSubscribe::OnWriteDone(bool ok) {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finish_.has_value() && !finished_) {
      finished_ = true;
      finish = finish_;
    }
  }
  if (finish.has_value()) {
    Finish(*finish);
    return;
  }
  if (!ok) {  // the client went away
    upstream_context_.TryCancel();
    return;
  }
  upstream_.StartRead(&event_);
}

void ForwardedSubscribe::OnCancel() { upstream_context_.TryCancel(); }

void ForwardedSubscribe::FinishClient(const grpc::Status& status) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (writing_) {
      finish_ = status;
      return;
    }
    finished_ = true;
  }
  Finish(status);
}

void ForwardedSubscribe::OnDone() { Unref(); }

}  // namespace ferry
