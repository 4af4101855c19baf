#include "daemon/api/subscribe_relay_stream.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/limits.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {

namespace {

// Events taken for one slot per pump: a bound on one message; a slot with
// more is woken again.
constexpr int kEventsPerSlot = 64;

}  // namespace

SubscribeRelayStream::SubscribeRelayStream(EventOutboxes* outboxes,
                                           SubscriptionPump* pump,
                                           Authenticate authenticate)
    : outboxes_(outboxes), pump_(pump), authenticate_(std::move(authenticate)) {
  StartRead(&request_);
}

void SubscribeRelayStream::Slot::Wake() {
  absl::MutexLock lock(&stream->mu_);
  wanted = true;
  stream->Schedule();
}

void SubscribeRelayStream::Slot::End(const absl::Status& why) {
  absl::MutexLock lock(&stream->mu_);
  if (!end.has_value()) end = why;
  stream->Schedule();
}

void SubscribeRelayStream::Schedule() {
  if (queued_ || writing_ || finished_) return;  // its next Pump sees it
  queued_ = true;
  Ref();
  pump_->Push(this);
}

void SubscribeRelayStream::OnReadDone(bool ok) {
  if (!ok) {
    FinishOnce(absl::CancelledError("the member closed SubscribeRelay"));
    return;
  }
  if (absl::Status s = CheckSubscribeRelayLimits(request_); !s.ok()) {
    FinishOnce(s);
    return;
  }
  Apply(request_);
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || end_.has_value()) return;
  }
  StartRead(&request_);
}

void SubscribeRelayStream::Apply(const v1::SubscribeRelayRequest& request) {
  for (const v1::RelayedSubscription& open : request.open()) Open(open);
  for (uint64_t id : request.close()) {
    std::unique_ptr<Slot> slot;
    {
      absl::MutexLock lock(&mu_);
      auto it = slots_.find(id);
      if (it == slots_.end()) continue;  // ended meanwhile, or never open
      slot = std::move(it->second);
      slots_.erase(it);
    }
    // After this the coordinator no longer calls the slot.
    if (slot->generation != 0) {
      outboxes_->CloseSubscription(slot->channel, slot->generation, {});
    }
  }
}

void SubscribeRelayStream::Open(const v1::RelayedSubscription& open) {
  absl::StatusOr<std::shared_ptr<const Participant>> rank =
      authenticate_(open.handle());
  Slot* slot = nullptr;
  {
    absl::MutexLock lock(&mu_);
    if (finished_ || end_.has_value()) return;
    if (slots_.count(open.id()) != 0) {
      // A member never reuses an id: this is not one.
      end_ = absl::InvalidArgumentError(absl::StrCat(
          "SubscribeRelay: subscription ", open.id(), " is already open"));
      Schedule();
      return;
    }
    // A member opens one per rank of its node; a caller that opens more
    // (or never reads the ends of refused ones) is not one.
    if (slots_.size() >= static_cast<size_t>(Limits::kMaxParticipantsPerDaemon)) {
      end_ = absl::ResourceExhaustedError(absl::StrCat(
          "SubscribeRelay: more than ", Limits::kMaxParticipantsPerDaemon,
          " subscriptions open on one call"));
      Schedule();
      return;
    }
    auto owned = std::make_unique<Slot>(
        this, open.id(), rank.ok() ? (*rank)->channel_id() : std::string());
    slot = owned.get();
    slots_[open.id()] = std::move(owned);
    if (!rank.ok()) {
      slot->end = rank.status();
      Schedule();
      return;
    }
  }
  // The coordinator may Wake the slot before this returns.
  absl::StatusOr<uint64_t> generation =
      outboxes_->OpenSubscription(*rank, slot);
  absl::MutexLock lock(&mu_);
  if (generation.ok()) {
    slot->generation = *generation;
    slot->wanted = true;
  } else if (!slot->end.has_value()) {
    slot->end = generation.status();
  }
  Schedule();
}

std::vector<SubscribeRelayStream::Taken> SubscribeRelayStream::TakeEvents(
    const std::vector<Taken>& wanted) {
  std::vector<Taken> taken;
  for (const Taken& w : wanted) {
    Taken t{w.id, w.channel, w.generation, {}};
    while (t.events.size() < static_cast<size_t>(kEventsPerSlot)) {
      std::optional<v1::UpdateEvent> next =
          outboxes_->NextEvent(w.channel, w.generation);
      if (!next.has_value()) break;
      t.events.push_back(*std::move(next));
    }
    if (!t.events.empty()) taken.push_back(std::move(t));
  }
  return taken;
}

void SubscribeRelayStream::Pump() {
  while (true) {
    std::vector<Taken> wanted;
    std::optional<absl::Status> finish;
    {
      absl::MutexLock lock(&mu_);
      queued_ = false;
      if (finished_ || writing_ || pumping_) return;
      if (end_.has_value()) {
        finished_ = true;
        finish = *end_;
      } else {
        bool ended = false;
        for (auto& [id, slot] : slots_) {
          ended = ended || slot->end.has_value();
          if (slot->generation == 0 || !slot->wanted) continue;
          slot->wanted = false;
          wanted.push_back(Taken{id, slot->channel, slot->generation, {}});
        }
        if (wanted.empty() && !ended) return;
        pumping_ = true;
      }
    }
    if (finish.has_value()) {
      Finish(ToGrpcStatus(*finish));
      return;
    }
    std::vector<Taken> taken = TakeEvents(wanted);

    std::vector<Taken> give_back;  // for slots gone meanwhile
    std::vector<std::unique_ptr<Slot>> ended;
    bool write = false;
    bool again = false;
    {
      absl::MutexLock lock(&mu_);
      pumping_ = false;
      response_.Clear();
      for (Taken& t : taken) {
        auto it = slots_.find(t.id);
        const bool live = !end_.has_value() && it != slots_.end() &&
                          it->second->generation == t.generation;
        if (!live) {
          give_back.push_back(std::move(t));
          continue;
        }
        if (t.events.size() == static_cast<size_t>(kEventsPerSlot)) {
          it->second->wanted = true;  // more may wait
        }
        for (const v1::UpdateEvent& e : t.events) {
          v1::RelayedEvent* r = response_.add_events();
          r->set_id(t.id);
          *r->mutable_event() = e;
        }
        in_flight_.push_back(std::move(t));
      }
      if (!end_.has_value()) {
        for (auto it = slots_.begin(); it != slots_.end();) {
          if (!it->second->end.has_value()) {
            ++it;
            continue;
          }
          v1::RelayedEnd* e = response_.add_ends();
          e->set_id(it->first);
          e->set_code(static_cast<int32_t>(it->second->end->code()));
          e->set_message(std::string(it->second->end->message()));
          ended.push_back(std::move(it->second));
          it = slots_.erase(it);
        }
      }
      if (end_.has_value()) {
        // The call is over: what was taken goes back to the outboxes.
        for (Taken& t : in_flight_) give_back.push_back(std::move(t));
        in_flight_.clear();
        finished_ = true;
        finish = *end_;
      } else if (response_.events_size() + response_.ends_size() > 0) {
        writing_ = true;
        write = true;
      } else {
        for (const auto& [id, slot] : slots_) again = again || slot->wanted;
      }
    }
    for (Taken& t : give_back) {
      outboxes_->CloseSubscription(t.channel, t.generation,
                                   std::move(t.events));
    }
    // Ended by the coordinator, which has forgotten them already.
    ended.clear();
    if (finish.has_value()) {
      Finish(ToGrpcStatus(*finish));
      return;
    }
    if (write) {
      StartWrite(&response_);
      return;
    }
    if (!again) return;
  }
}

void SubscribeRelayStream::OnWriteDone(bool ok) {
  {
    absl::MutexLock lock(&mu_);
    writing_ = false;
    if (ok) in_flight_.clear();  // else OnDone gives them back
  }
  if (!ok) {
    FinishOnce(absl::CancelledError("the member went away"));
    return;
  }
  Pump();
}

void SubscribeRelayStream::OnCancel() {
  FinishOnce(absl::CancelledError("the member cancelled SubscribeRelay"));
}

void SubscribeRelayStream::FinishOnce(const absl::Status& why) {
  {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    if (!end_.has_value()) end_ = why;
    // A write in flight or a Pump under way finishes the call after it.
    if (writing_ || pumping_) return;
    finished_ = true;
  }
  Finish(ToGrpcStatus(why));
}

void SubscribeRelayStream::OnDone() {
  std::map<uint64_t, std::unique_ptr<Slot>> slots;
  std::vector<Taken> unsent;
  {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return !pumping_;
    };
    mu_.Await(absl::Condition(&idle));
    finished_ = true;  // no more scheduling
    slots = std::move(slots_);
    slots_.clear();
    unsent = std::move(in_flight_);
    in_flight_.clear();
  }
  // Each rank's events taken and not written go back to its outbox; after
  // this the coordinator no longer calls the slots.
  for (Taken& t : unsent) {
    outboxes_->CloseSubscription(t.channel, t.generation, std::move(t.events));
  }
  for (auto& [id, slot] : slots) {
    if (slot->generation != 0) {
      outboxes_->CloseSubscription(slot->channel, slot->generation, {});
    }
  }
  slots.clear();
  Unref();
}

}  // namespace ferry
