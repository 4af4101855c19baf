// SubscribeRelayStream: a member daemon's Versions.SubscribeRelay on the
// coordinator: the Subscribe streams of every rank on the member's node,
// carried on one gRPC callback stream. Each rank's subscription is a Slot
// (the coordinator's EventSink for that rank); the stream takes the events
// of every slot the coordinator woke and writes them in one message.
//
// Why: a rank's own stream costs the coordinator a gRPC message per event
// (4 per engine rank per version: 3,072 at 1,024 ranks), and its member a
// stream relayed per rank; one stream per member costs a message per
// member per step (docs/benchmarks.md, "A fleet on one coordinator").
//
// Locking: the coordinator calls a Slot's Wake and End with its lock held;
// they take only this stream's mu_ (a leaf) and hand the stream to the
// SubscriptionPump. Pump and the reactions call the coordinator with no
// lock of this stream held.
//
// Owner: gRPC until OnDone; the pump holds a reference while the stream is
// queued on it; the last reference deletes it.
#ifndef FERRY_DAEMON_API_SUBSCRIBE_RELAY_STREAM_H_
#define FERRY_DAEMON_API_SUBSCRIBE_RELAY_STREAM_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/api/subscribe_stream.h"
#include "daemon/registry/participant.h"
#include "daemon/versions/event_sink.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

class SubscribeRelayStream final
    : public grpc::ServerBidiReactor<v1::SubscribeRelayRequest,
                                     v1::SubscribeRelayResponse>,
      public PumpedStream {
 public:
  // The destination rank a handle names, as Subscribe authenticates it.
  using Authenticate =
      std::function<absl::StatusOr<std::shared_ptr<const Participant>>(
          const v1::ParticipantHandle&)>;

  SubscribeRelayStream(EventOutboxes* outboxes, SubscriptionPump* pump,
                       Authenticate authenticate);

  // grpc::ServerBidiReactor.
  void OnReadDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_);
  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_);
  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_);
  void OnDone() override ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // One rank's subscription on this stream: the coordinator's sink for it.
  struct Slot final : EventSink {
    Slot(SubscribeRelayStream* s, uint64_t i, std::string c)
        : stream(s), id(i), channel(std::move(c)) {}
    void Wake() override;                       // coordinator's lock held
    void End(const absl::Status& why) override;  // likewise

    SubscribeRelayStream* const stream;
    const uint64_t id;             // the member's
    const std::string channel;     // the rank's channel id
    // Set under the stream's mu_:
    uint64_t generation = 0;       // 0: not open yet
    bool wanted = false;           // the outbox may hold events
    std::optional<absl::Status> end;
  };
  // Events taken for one slot, to write or to give back.
  struct Taken {
    uint64_t id;
    std::string channel;
    uint64_t generation;
    std::vector<v1::UpdateEvent> events;
  };

  ~SubscribeRelayStream() override = default;

  // Opens and closes what the member asked for; calls the coordinator.
  void Apply(const v1::SubscribeRelayRequest& request)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Open(const v1::RelayedSubscription& open) ABSL_LOCKS_EXCLUDED(mu_);
  // Queues the stream on the pump unless it is queued or writing.
  void Schedule() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Writes every woken slot's events and every end in one message, if no
  // write is in flight; finishes the call once it is over. No lock held.
  void Pump() override ABSL_LOCKS_EXCLUDED(mu_);
  // Takes the events of `wanted` slots from the coordinator.
  std::vector<Taken> TakeEvents(const std::vector<Taken>& wanted);
  void FinishOnce(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  void Ref() { refs_.fetch_add(1); }
  void Unref() override {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  EventOutboxes* const outboxes_;  // the coordinator's
  SubscriptionPump* const pump_;
  const Authenticate authenticate_;
  std::atomic<int> refs_{1};  // gRPC's, until OnDone
  v1::SubscribeRelayRequest request_;  // the read in flight

  absl::Mutex mu_;  // a leaf: held for no call out
  std::map<uint64_t, std::unique_ptr<Slot>> slots_ ABSL_GUARDED_BY(mu_);
  bool queued_ ABSL_GUARDED_BY(mu_) = false;    // on the pump
  bool pumping_ ABSL_GUARDED_BY(mu_) = false;   // Pump between its locks
  bool writing_ ABSL_GUARDED_BY(mu_) = false;   // a write in flight
  std::optional<absl::Status> end_ ABSL_GUARDED_BY(mu_);  // finish with it
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish called
  v1::SubscribeRelayResponse response_;  // the write in flight's
  // The write in flight's events, given back if it fails.
  std::vector<Taken> in_flight_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_API_SUBSCRIBE_RELAY_STREAM_H_
