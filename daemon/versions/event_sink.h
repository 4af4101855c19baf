// EventSink: where the coordinator hands one destination rank's update
// events: the rank's open Subscribe stream (daemon/api/subscribe_stream.h).
//
// Why an interface and not a thread per stream: a fleet's coordinator
// serves a thousand ranks' streams. Each rank's stream waits on nothing;
// the coordinator wakes only the sink whose outbox got an event, and the
// sink writes it from gRPC's own threads (docs/benchmarks.md, "A fleet on
// one coordinator").
//
// Both methods are called with the coordinator's lock held: they must not
// block, and must not call the coordinator (it is not reentrant).
#ifndef FERRY_DAEMON_VERSIONS_EVENT_SINK_H_
#define FERRY_DAEMON_VERSIONS_EVENT_SINK_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/registry/participant.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

class EventSink {
 public:
  virtual ~EventSink() = default;
  // The rank's outbox holds an event: take it with
  // VersionCoordinator::NextEvent, later, outside this call.
  virtual void Wake() = 0;
  // The subscription is over: a newer Subscribe of the rank replaced it
  // (CANCELLED), the registration ended (NOT_FOUND) or ferryd is stopping
  // (UNAVAILABLE). The coordinator forgets the sink before this returns.
  virtual void End(const absl::Status& why) = 0;
};

// EventOutboxes: the ranks' outboxes a Subscribe stream takes events from
// (the VersionCoordinator implements it; the stream sees only this).
class EventOutboxes {
 public:
  virtual ~EventOutboxes() = default;
  // A Subscribe stream of `destination` opened: its queued events and the
  // asks it has not answered go to `sink` from now on, oldest first; a
  // previous sink of the rank is ended (CANCELLED). The subscription's
  // generation, for the calls below. NOT_FOUND when the registration
  // ended; UNAVAILABLE when ferryd is stopping.
  virtual absl::StatusOr<uint64_t> OpenSubscription(
      const std::shared_ptr<const Participant>& destination,
      EventSink* sink) = 0;
  // The subscription's next event, taken off the rank's outbox; none when
  // the outbox is empty or the subscription is over.
  virtual std::optional<v1::UpdateEvent> NextEvent(
      const std::string& channel_id, uint64_t generation) = 0;
  // The stream ended (the client went away, cancelled, or End was called):
  // the sink is forgotten; `unsent`, events taken and not written (oldest
  // first), go back to the front of the outbox for the rank's next
  // subscription.
  virtual void CloseSubscription(const std::string& channel_id,
                                 uint64_t generation,
                                 std::vector<v1::UpdateEvent> unsent) = 0;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_EVENT_SINK_H_
