#include "daemon/cluster/subscription_relay.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {

// The upstream call. Fields but the reactor's own are guarded by the
// relay's mu_. A hold keeps OnDone from running until no write can start.
class SubscriptionRelay::Upstream final
    : public grpc::ClientBidiReactor<v1::SubscribeRelayRequest,
                                     v1::SubscribeRelayResponse> {
 public:
  explicit Upstream(SubscriptionRelay* relay) : relay_(relay) {}

  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone(const grpc::Status& status) override;

  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }
  // Removes the hold once no write can start and none is in flight.
  void ReleaseHoldIfIdle() ABSL_LOCKS_EXCLUDED(relay_->mu_);

  SubscriptionRelay* const relay_;
  grpc::ClientContext context_;
  v1::SubscribeRelayResponse read_;
  v1::SubscribeRelayRequest write_;  // the write in flight
  // The relay's pointer (until detached) and gRPC's (until OnDone).
  std::atomic<int> refs_{2};

  // Guarded by relay_->mu_:
  std::map<uint64_t, LocalStream*> streams_;  // each holds a reference
  v1::SubscribeRelayRequest pending_;         // opens and closes to send
  bool started_ = false;  // StartCall done: writes may start
  bool writing_ = false;
  bool closing_ = false;  // the call is ending: no more writes
  bool hold_released_ = false;
};

// A rank's Subscribe on this member.
class SubscriptionRelay::LocalStream final
    : public grpc::ServerWriteReactor<v1::UpdateEvent> {
 public:
  // `up` (a reference taken for this stream) is null for a refused one.
  LocalStream(SubscriptionRelay* relay, Upstream* up, uint64_t id)
      : relay_(relay), up_(up), id_(id) {}

  // An event for the client, written after those before it.
  void Push(v1::UpdateEvent event) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the stream with `why`, after the write in flight.
  void End(const grpc::Status& why) ABSL_LOCKS_EXCLUDED(mu_);

  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_);
  void OnCancel() override {
    End(grpc::Status(grpc::StatusCode::CANCELLED,
                     "the client cancelled Subscribe"));
  }
  void OnDone() override;

  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

 private:
  ~LocalStream() override = default;

  SubscriptionRelay* const relay_;
  Upstream* const up_;
  const uint64_t id_;
  std::atomic<int> refs_{1};  // gRPC's, until OnDone

  absl::Mutex mu_;  // a leaf
  std::deque<v1::UpdateEvent> queue_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  std::optional<grpc::Status> end_ ABSL_GUARDED_BY(mu_);
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  v1::UpdateEvent event_;  // the write in flight's
};

// ---------------------------------------------------------------------------
// LocalStream

void SubscriptionRelay::LocalStream::Push(v1::UpdateEvent event) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || end_.has_value()) return;
    if (writing_) {
      queue_.push_back(std::move(event));
      return;
    }
    writing_ = true;
    event_ = std::move(event);
  }
  StartWrite(&event_);
}

void SubscriptionRelay::LocalStream::End(const grpc::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (writing_) {
      if (!end_.has_value()) end_ = why;
      return;
    }
    finished_ = true;
  }
  Finish(why);
}

void SubscriptionRelay::LocalStream::OnWriteDone(bool ok) {
  std::optional<grpc::Status> finish;
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (finished_) return;
    if (!ok) {
      finish = grpc::Status(grpc::StatusCode::CANCELLED,
                            "the client went away");
    } else if (end_.has_value()) {
      finish = end_;
    } else if (!queue_.empty()) {
      writing_ = true;
      event_ = std::move(queue_.front());
      queue_.pop_front();
    } else {
      return;
    }
    if (finish.has_value()) finished_ = true;
  }
  if (finish.has_value()) {
    Finish(*finish);
    return;
  }
  StartWrite(&event_);
}

void SubscriptionRelay::LocalStream::OnDone() {
  if (up_ != nullptr) {
    relay_->Close(up_, id_);
    up_->Unref();
  }
  Unref();
}

// ---------------------------------------------------------------------------
// Upstream

void SubscriptionRelay::Upstream::OnReadDone(bool ok) {
  if (!ok) {
    // The call is ending: new subscriptions go on a new one.
    bool detached = false;
    {
      absl::MutexLock lock(&relay_->mu_);
      closing_ = true;
      if (relay_->upstream_ == this) {
        relay_->upstream_ = nullptr;
        detached = true;
      }
    }
    ReleaseHoldIfIdle();
    if (detached) Unref();
    return;
  }
  // Delivered before the next read starts: a stream's events stay in order.
  relay_->Deliver(this, read_);
  read_.Clear();
  StartRead(&read_);
}

void SubscriptionRelay::Upstream::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&relay_->mu_);
    writing_ = false;
    if (!ok) closing_ = true;  // the read fails too, and ends the call
  }
  if (ok) relay_->Flush(this);
  ReleaseHoldIfIdle();
}

void SubscriptionRelay::Upstream::ReleaseHoldIfIdle() {
  {
    absl::MutexLock lock(&relay_->mu_);
    if (!closing_ || writing_ || hold_released_) return;
    hold_released_ = true;
  }
  RemoveHold();
}

void SubscriptionRelay::Upstream::OnDone(const grpc::Status& status) {
  relay_->Ended(this, status);
  Unref();
}

// ---------------------------------------------------------------------------
// SubscriptionRelay

SubscriptionRelay::~SubscriptionRelay() {
  Upstream* up = nullptr;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    up = upstream_;
    if (up != nullptr) up->Ref();
  }
  if (up != nullptr) {
    up->context_.TryCancel();
    up->Unref();
  }
  absl::MutexLock lock(&mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return calls_ == 0;
  };
  mu_.Await(absl::Condition(&done));
}

grpc::ServerWriteReactor<v1::UpdateEvent>* SubscriptionRelay::Subscribe(
    const v1::SubscribeRequest& request) {
  if (absl::Status s = CheckHandleLimits(request.handle()); !s.ok()) {
    auto* refused = new LocalStream(this, nullptr, 0);
    refused->End(ToGrpcStatus(s));
    return refused;
  }
  Upstream* up = nullptr;
  LocalStream* stream = nullptr;
  bool start = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      stream = new LocalStream(this, nullptr, 0);
    } else {
      if (upstream_ == nullptr) {
        upstream_ = new Upstream(this);
        ++calls_;
        start = true;
      }
      up = upstream_;
      up->Ref();  // the stream's
      const uint64_t id = next_id_++;
      stream = new LocalStream(this, up, id);
      stream->Ref();  // the upstream's map's
      up->streams_[id] = stream;
      v1::RelayedSubscription* open = up->pending_.add_open();
      open->set_id(id);
      *open->mutable_handle() = request.handle();
    }
  }
  if (up == nullptr) {
    stream->End(grpc::Status(grpc::StatusCode::UNAVAILABLE,
                             "ferryd is shutting down"));
    return stream;
  }
  if (start) {
    // Other ranks' Subscribes may queue opens on `up` meanwhile; none
    // writes before the call is bound and started (Flush checks).
    stub_->async()->SubscribeRelay(&up->context_, up);
    up->AddHold();
    up->StartRead(&up->read_);
    up->StartCall();
    absl::MutexLock lock(&mu_);
    up->started_ = true;
  }
  Flush(up);
  return stream;
}

void SubscriptionRelay::Flush(Upstream* up) {
  {
    absl::MutexLock lock(&mu_);
    if (!up->started_ || up->closing_ || up->writing_) return;
    if (up->pending_.open_size() + up->pending_.close_size() == 0) return;
    up->write_ = std::move(up->pending_);
    up->pending_.Clear();
    up->writing_ = true;
  }
  up->StartWrite(&up->write_);  // the hold keeps the call until it is done
}

void SubscriptionRelay::Close(Upstream* up, uint64_t id) {
  LocalStream* stream = nullptr;
  {
    absl::MutexLock lock(&mu_);
    auto it = up->streams_.find(id);
    if (it == up->streams_.end()) return;  // ended by the coordinator
    stream = it->second;
    up->streams_.erase(it);
    if (!up->closing_) up->pending_.add_close(id);
  }
  stream->Unref();
  Flush(up);
}

void SubscriptionRelay::Deliver(Upstream* up,
                             const v1::SubscribeRelayResponse& response) {
  std::vector<std::pair<LocalStream*, const v1::UpdateEvent*>> events;
  std::vector<std::pair<LocalStream*, grpc::Status>> ends;
  {
    absl::MutexLock lock(&mu_);
    for (const v1::RelayedEvent& e : response.events()) {
      auto it = up->streams_.find(e.id());
      if (it == up->streams_.end()) continue;  // its client went away
      it->second->Ref();
      events.emplace_back(it->second, &e.event());
    }
    for (const v1::RelayedEnd& e : response.ends()) {
      auto it = up->streams_.find(e.id());
      if (it == up->streams_.end()) continue;
      ends.emplace_back(
          it->second,
          grpc::Status(static_cast<grpc::StatusCode>(e.code()), e.message()));
      up->streams_.erase(it);  // the map's reference moves to `ends`
    }
  }
  for (auto& [stream, event] : events) {
    stream->Push(*event);
    stream->Unref();
  }
  for (auto& [stream, status] : ends) {
    stream->End(status);
    stream->Unref();
  }
}

void SubscriptionRelay::Ended(Upstream* up, const grpc::Status& status) {
  std::map<uint64_t, LocalStream*> streams;
  bool detached = false;
  {
    absl::MutexLock lock(&mu_);
    streams = std::move(up->streams_);
    up->streams_.clear();
    up->closing_ = true;
    if (upstream_ == up) {
      upstream_ = nullptr;
      detached = true;
    }
  }
  // Counted down last (below): the destructor waits for it, and the relay
  // must outlive the streams' ends.
  // The client subscribes again (UNAVAILABLE), on a new call.
  const grpc::Status why(
      grpc::StatusCode::UNAVAILABLE,
      absl::StrCat("the relay of this node's Subscribe streams to the "
                   "coordinator ended: ",
                   status.ok() ? "OK" : status.error_message()));
  for (auto& [id, stream] : streams) {
    stream->End(why);
    stream->Unref();
  }
  if (detached) up->Unref();
  absl::MutexLock lock(&mu_);
  --calls_;
}

}  // namespace ferry
