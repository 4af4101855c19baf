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

}  // namespace
}  // namespace testing
}  // namespace ferry
