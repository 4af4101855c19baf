#include "daemon/api/subscribe_stream.h"

#include <utility>

#include "proto/grpc_status.h"

namespace ferry {

SubscriptionPump::SubscriptionPump() : thread_([this] { Loop(); }) {}

SubscriptionPump::~SubscriptionPump() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  for (PumpedStream* s : queue_) s->Unref();
}

void SubscriptionPump::Push(PumpedStream* stream) {
  absl::MutexLock lock(&mu_);
  queue_.push_back(stream);
}

void SubscriptionPump::Loop() {
  while (true) {
    PumpedStream* s = nullptr;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return stopping_ || !queue_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      s = queue_.front();
      queue_.pop_front();
    }
    s->Pump();
    s->Unref();
  }
}

SubscribeStream::SubscribeStream(EventOutboxes* outboxes,
                                 SubscriptionPump* pump,
                                 std::shared_ptr<const Participant> destination)
    : outboxes_(outboxes),
      pump_(pump),
      channel_(destination->channel_id()) {
  // The coordinator may Wake this stream before the call returns (events
  // are queued): Pump waits for the generation, then runs below.
  absl::StatusOr<uint64_t> generation =
      outboxes_->OpenSubscription(destination, this);
  if (!generation.ok()) {
    {
      absl::MutexLock lock(&mu_);
      finished_ = true;
    }
    Finish(ToGrpcStatus(generation.status()));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    generation_ = *generation;
    wanted_ = true;
  }
  Pump();
}

void SubscribeStream::Wake() {
  absl::MutexLock lock(&mu_);
  wanted_ = true;
  if (queued_ || writing_ || finished_) return;  // its next Pump sees it
  queued_ = true;
  Ref();
  pump_->Push(this);
}

void SubscribeStream::End(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (!end_.has_value()) end_ = why;
  if (queued_ || finished_) return;
  queued_ = true;
  Ref();
  pump_->Push(this);
}

void SubscribeStream::Pump() {
  while (true) {
    uint64_t generation = 0;
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      queued_ = false;
      if (finished_ || writing_ || generation_ == 0) return;
      if (end_.has_value()) {
        finished_ = true;
        finish = *end_;
      } else if (!wanted_) {
        return;
      } else {
        wanted_ = false;
        writing_ = true;
        generation = generation_;
      }
    }
    if (finish.has_value()) {
      Finish(ToGrpcStatus(*finish));
      return;
    }
    std::optional<v1::UpdateEvent> next =
        outboxes_->NextEvent(channel_, generation);
    {
      absl::MutexLock lock(&mu_);
      if (!next.has_value()) {
        writing_ = false;
        continue;  // a Wake in between set wanted_ again
      }
      event_ = *std::move(next);
    }
    StartWrite(&event_);
    return;
  }
}

void SubscribeStream::OnWriteDone(bool ok) {
  if (!ok) {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      unsent_ = std::move(event_);
    }
    FinishOnce(absl::CancelledError("the client went away"));
    return;
  }
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    wanted_ = true;  // the outbox may hold more
  }
  Pump();
}

void SubscribeStream::OnCancel() {
  FinishOnce(absl::CancelledError("the client cancelled Subscribe"));
}

void SubscribeStream::FinishOnce(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (writing_) {  // OnWriteDone pumps, and the pump finishes
      if (!end_.has_value()) end_ = why;
      return;
    }
    finished_ = true;
  }
  Finish(ToGrpcStatus(why));
}

void SubscribeStream::OnDone() {
  uint64_t generation;
  std::vector<v1::UpdateEvent> unsent;
  {
    absl::MutexLock lock(&mu_);
    generation = generation_;
    if (unsent_.has_value()) unsent.push_back(*std::move(unsent_));
  }
  // After this the coordinator no longer wakes the stream.
  if (generation != 0) {
    outboxes_->CloseSubscription(channel_, generation, std::move(unsent));
  }
  Unref();
}

}  // namespace ferry
