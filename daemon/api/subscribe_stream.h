// SubscribeStream: one destination rank's Versions.Subscribe on the
// coordinator, as a gRPC callback stream: no thread waits on it. The
// coordinator wakes it (EventSink) when the rank's outbox gets an event;
// it takes events one at a time and writes each from gRPC's threads.
//
// Why: a thread per stream, each waking on every change of the
// coordinator, cost a fleet's coordinator a thread per rank and most of
// its CPU in context switches (docs/benchmarks.md, "A fleet on one
// coordinator").
//
// The coordinator calls Wake and End with its lock held, so neither may
// call back into it, nor into gRPC (a gRPC call may run a reaction inline,
// and the reaction calls the coordinator). They hand the stream to a
// SubscriptionPump, one thread for all streams, which does the work.
//
// Owner: gRPC until OnDone; the pump holds a reference while the stream is
// queued on it; the last reference deletes it.
#ifndef FERRY_DAEMON_API_SUBSCRIBE_STREAM_H_
#define FERRY_DAEMON_API_SUBSCRIBE_STREAM_H_

#include <atomic>
#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "daemon/registry/participant.h"
#include "daemon/versions/event_sink.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

// A stream the pump runs (a rank's SubscribeStream, a member's
// SubscribeRelayStream): Pump does the stream's work with no lock held;
// Unref drops the reference the pump was given.
class PumpedStream {
 public:
  virtual void Pump() = 0;
  virtual void Unref() = 0;

 protected:
  virtual ~PumpedStream() = default;
};

// Runs streams' Pump on a thread of its own, for wakes that come with the
// coordinator's lock held. Thread-safe.
class SubscriptionPump {
 public:
  SubscriptionPump();
  ~SubscriptionPump();  // drops what is queued, joins the thread

  // Queues `stream` (the caller took a reference for the pump).
  void Push(PumpedStream* stream) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop();

  absl::Mutex mu_;
  std::deque<PumpedStream*> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

class SubscribeStream final : public grpc::ServerWriteReactor<v1::UpdateEvent>,
                              public EventSink,
                              public PumpedStream {
 public:
  // Opens the rank's subscription, or finishes at once with why it cannot.
  SubscribeStream(EventOutboxes* outboxes, SubscriptionPump* pump,
                  std::shared_ptr<const Participant> destination);

  // EventSink; the coordinator's lock is held.
  void Wake() override ABSL_LOCKS_EXCLUDED(mu_);
  void End(const absl::Status& why) override ABSL_LOCKS_EXCLUDED(mu_);

  // grpc::ServerWriteReactor.
  void OnWriteDone(bool ok) override ABSL_LOCKS_EXCLUDED(mu_);
  void OnCancel() override ABSL_LOCKS_EXCLUDED(mu_);
  void OnDone() override;

 private:
  ~SubscribeStream() override = default;

  // Writes the next event if none is in flight, or finishes the stream if
  // it is over. No lock held.
  void Pump() override ABSL_LOCKS_EXCLUDED(mu_);
  // Finishes with `why` now, or after the write in flight.
  void FinishOnce(const absl::Status& why) ABSL_LOCKS_EXCLUDED(mu_);
  void Ref() { refs_.fetch_add(1); }
  void Unref() override {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  EventOutboxes* const outboxes_;  // the coordinator's
  SubscriptionPump* const pump_;
  const std::string channel_;  // the rank's channel id
  std::atomic<int> refs_{1};   // gRPC's, until OnDone

  absl::Mutex mu_;  // a leaf: held for no call out
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // 0: not open (yet)
  bool wanted_ ABSL_GUARDED_BY(mu_) = false;   // the outbox may hold events
  bool queued_ ABSL_GUARDED_BY(mu_) = false;   // on the pump
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // a write in flight
  std::optional<absl::Status> end_ ABSL_GUARDED_BY(mu_);  // finish with it
  bool finished_ ABSL_GUARDED_BY(mu_) = false;  // Finish called
  v1::UpdateEvent event_;  // the write in flight's; only its writer uses it
  // An event taken and not written (the client went away): back to the
  // outbox when the stream closes.
  std::optional<v1::UpdateEvent> unsent_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_API_SUBSCRIBE_STREAM_H_
