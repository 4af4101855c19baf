// Versions.SubscribeRelay, as a member daemon uses it: several ranks'
// subscriptions on one call, each behaving as that rank's own Subscribe
// stream would (its events tagged with the member's id, a forged handle
// refused in its own end, a newer subscription of the rank replacing the
// older with CANCELLED and getting the unanswered event again), and a
// call that breaks the relay's rules ended with INVALID_ARGUMENT. The
// member's side (daemon/cluster/subscription_relay.h) carries every event
// of the multi-node and fleet tests.
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

using Relay = grpc::ClientReaderWriter<v1::SubscribeRelayRequest,
                                       v1::SubscribeRelayResponse>;

// What the coordinator sent on the relay so far.
struct Received {
  std::map<uint64_t, std::vector<v1::UpdateEvent>> events;
  std::map<uint64_t, grpc::Status> ends;

  // Reads until `done` holds; false when the call ended first.
  template <typename Done>
  bool ReadUntil(Relay& relay, Done done) {
    while (!done()) {
      v1::SubscribeRelayResponse r;
      if (!relay.Read(&r)) return false;
      for (const v1::RelayedEvent& e : r.events()) {
        events[e.id()].push_back(e.event());
      }
      for (const v1::RelayedEnd& e : r.ends()) {
        ends[e.id()] =
            grpc::Status(static_cast<grpc::StatusCode>(e.code()), e.message());
      }
    }
    return true;
  }
};

void Open(v1::SubscribeRelayRequest& request, uint64_t id,
          const v1::ParticipantHandle& handle) {
  v1::RelayedSubscription* open = request.add_open();
  open->set_id(id);
  *open->mutable_handle() = handle;
}

TEST_CASE("SubscribeRelay carries several ranks' subscriptions, each as "
          "its own Subscribe stream",
          "[daemon][relay]") {
  TestDaemon d;
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(d, t0);
  RegisterSource(d, t1);
  std::vector<std::unique_ptr<EngineRank>> ranks;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(std::make_unique<EngineRank>("b0", r, "policy"));
    RegisterDestination(d, *ranks.back());
  }

  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(60));
  std::unique_ptr<Relay> relay = d.versions->SubscribeRelay(&context);
  v1::SubscribeRelayRequest open;
  for (uint64_t id = 1; id <= 4; ++id) Open(open, id, ranks[id - 1]->handle);
  v1::ParticipantHandle forged = ranks[0]->handle;
  forged.set_token("forged");
  Open(open, 5, forged);
  REQUIRE(relay->Write(open));

  Received got;
  REQUIRE(got.ReadUntil(*relay, [&] { return got.ends.count(5) == 1; }));
  CHECK(got.ends[5].error_code() == grpc::StatusCode::PERMISSION_DENIED);

  // A version begins: each rank's PREPARE arrives under its own id.
  grpc::ClientContext c1;
  v1::BeginVersionRequest begin;
  *begin.mutable_handle() = t0.handle;
  begin.set_version(1);
  v1::BeginVersionResponse br;
  const grpc::Status begun = d.versions->BeginVersion(&c1, begin, &br);
  INFO(begun.error_message());
  REQUIRE(begun.ok());
  REQUIRE(got.ReadUntil(*relay, [&] {
    for (uint64_t id = 1; id <= 4; ++id) {
      if (got.events[id].empty()) return false;
    }
    return true;
  }));
  for (uint64_t id = 1; id <= 4; ++id) {
    INFO("subscription " << id);
    REQUIRE(got.events[id].size() == 1);
    const v1::UpdateEvent& e = got.events[id][0];
    CHECK(e.kind() == v1::UPDATE_EVENT_KIND_PREPARE);
    CHECK(e.version() == 1);
    CHECK(e.ack_timeout_ms() > 0);
  }
  CHECK(got.ends.count(1) == 0);

  // Rank 0 subscribes again (its client reconnected): the old subscription
  // ends CANCELLED, and the new one gets the unanswered PREPARE again.
  const uint64_t prepare_id = got.events[1][0].event_id();
  v1::SubscribeRelayRequest again;
  Open(again, 6, ranks[0]->handle);
  REQUIRE(relay->Write(again));
  REQUIRE(got.ReadUntil(*relay, [&] {
    return got.ends.count(1) == 1 && !got.events[6].empty();
  }));
  CHECK(got.ends[1].error_code() == grpc::StatusCode::CANCELLED);
  CHECK(got.events[6][0].kind() == v1::UPDATE_EVENT_KIND_PREPARE);
  CHECK(got.events[6][0].event_id() == prepare_id);

  // An id already open breaks the relay's rules: the call ends.
  v1::SubscribeRelayRequest duplicate;
  Open(duplicate, 3, ranks[2]->handle);
  REQUIRE(relay->Write(duplicate));
  CHECK_FALSE(got.ReadUntil(*relay, [] { return false; }));
  const grpc::Status s = relay->Finish();
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("subscription 3 is already open") !=
        std::string::npos);
}

// A relay call of `messages`, each written in turn; the call's status.
grpc::Status RelayOf(TestDaemon& d,
                     const std::vector<v1::SubscribeRelayRequest>& messages,
                     Received* got) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  std::unique_ptr<Relay> relay = d.versions->SubscribeRelay(&context);
  for (const v1::SubscribeRelayRequest& m : messages) {
    if (!relay->Write(m)) break;
  }
  relay->WritesDone();
  got->ReadUntil(*relay, [] { return false; });
  return relay->Finish();
}

TEST_CASE("SubscribeRelay refuses garbage: the call's own errors name the "
          "field, a subscription's in its end, and ferryd goes on",
          "[daemon][relay]") {
  TestDaemon d;
  EngineRank rank("b0", 0, "policy");
  RegisterDestination(d, rank);
  Received got;

  v1::SubscribeRelayRequest zero;
  Open(zero, 0, rank.handle);
  grpc::Status s = RelayOf(d, {zero}, &got);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("open[0].id") != std::string::npos);

  v1::SubscribeRelayRequest long_id;
  v1::ParticipantHandle huge = rank.handle;
  huge.set_participant_id(std::string(5000, 'x'));
  Open(long_id, 1, huge);
  s = RelayOf(d, {long_id}, &got);
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("open[0].handle.participant_id") !=
        std::string::npos);

  v1::SubscribeRelayRequest too_many;
  for (int i = 0; i < 4097; ++i) too_many.add_close(i + 1);
  s = RelayOf(d, {too_many}, &got);
  CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(s.error_message().find("4097") != std::string::npos);

  // An unknown participant and a close of an id never opened: the first
  // ends NOT_FOUND on its own, the second is ignored, the call goes on to
  // serve the real rank.
  v1::SubscribeRelayRequest mixed;
  v1::ParticipantHandle unknown = rank.handle;
  unknown.set_participant_id("dst.nobody.0.9999");
  Open(mixed, 7, unknown);
  mixed.add_close(12345);
  Open(mixed, 8, rank.handle);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(30));
  std::unique_ptr<Relay> relay = d.versions->SubscribeRelay(&context);
  REQUIRE(relay->Write(mixed));
  Received mine;
  REQUIRE(mine.ReadUntil(*relay, [&] { return mine.ends.count(7) == 1; }));
  CHECK(mine.ends[7].error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(mine.ends.count(8) == 0);
  context.TryCancel();
  relay->Finish();
  ExpectAnswers(d);
}

}  // namespace
}  // namespace testing
}  // namespace ferry
