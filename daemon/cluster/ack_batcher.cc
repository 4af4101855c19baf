#include "daemon/cluster/ack_batcher.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/limits.h"
#include "proto/grpc_status.h"

namespace ferry {

absl::Status AckBatcher::Ack(const v1::AckRequest& ack,
                             std::chrono::system_clock::time_point deadline) {
  Pending mine;
  mine.ack = &ack;
  mine.deadline = deadline;
  absl::MutexLock lock(&mu_);
  queue_.push_back(&mine);
  while (!mine.done) {
    if (sending_) {
      auto changed = [this, &mine]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return mine.done || !sending_;
      };
      mu_.Await(absl::Condition(&changed));
      continue;
    }
    // No call in flight: this thread sends what is queued, its own ack
    // among it.
    std::deque<Pending*> batch;
    while (!queue_.empty() &&
           batch.size() < static_cast<size_t>(Limits::kMaxAcksPerBatch)) {
      batch.push_back(queue_.front());
      queue_.pop_front();
    }
    sending_ = true;
    mu_.Unlock();
    Send(batch);
    mu_.Lock();
    sending_ = false;
    for (Pending* p : batch) p->done = true;
  }
  return mine.result;
}

void AckBatcher::Send(const std::deque<Pending*>& batch) {
  v1::AckBatchRequest request;
  auto deadline = batch.front()->deadline;
  for (const Pending* p : batch) {
    *request.add_acks() = *p->ack;
    deadline = std::max(deadline, p->deadline);
  }
  grpc::ClientContext context;
  context.set_deadline(deadline);
  v1::AckBatchResponse response;
  const grpc::Status s = stub_->AckBatch(&context, request, &response);
  if (s.ok() && response.outcomes_size() != request.acks_size()) {
    for (Pending* p : batch) {
      p->result = absl::InternalError(absl::StrCat(
          "the coordinator answered ", response.outcomes_size(),
          " of a batch of ", request.acks_size(), " acks"));
    }
    return;
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    if (!s.ok()) {
      batch[i]->result = FromGrpcStatus(s);
      continue;
    }
    const v1::AckOutcome& o = response.outcomes(static_cast<int>(i));
    batch[i]->result =
        o.code() == 0
            ? absl::OkStatus()
            : absl::Status(static_cast<absl::StatusCode>(o.code()), o.message());
  }
}

}  // namespace ferry
