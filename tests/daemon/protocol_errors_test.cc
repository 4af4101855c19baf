// Protocol misuse and bad input get the error code of docs/api.md's error
// model and a message naming the thing at fault; leases expire; the socket
// is private.
#include <sys/stat.h>

#include <functional>
#include <string>

#include "catch2/catch.hpp"
#include "common/clock.h"
#include "daemon/registry/registry.h"
#include "tests/support/eventually.h"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

bool Contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

}  // namespace

TEST_CASE("protocol misuse gets the right code and names the thing",
          "[daemon][errors]") {
  TestDaemon d;
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(d, t0);

  SECTION("begin before every source rank registered") {
    grpc::ClientContext c;
    v1::BeginVersionRequest begin;
    *begin.mutable_handle() = t0.handle;
    begin.set_version(1);
    v1::BeginVersionResponse resp;
    grpc::Status s = d.versions->BeginVersion(&c, begin, &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(Contains(s.error_message(), "source ranks [1]"));
  }

  RegisterSource(d, t1);

  SECTION("commit without begin") {
    grpc::ClientContext c;
    v1::CommitVersionRequest commit;
    *commit.mutable_handle() = t1.handle;
    commit.set_version(5);
    v1::CommitVersionResponse resp;
    grpc::Status s = d.versions->CommitVersion(&c, commit, &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(Contains(s.error_message(),
                   "stream policy: CommitVersion(5) without BeginVersion(5) "
                   "from rank 1"));
  }

  SECTION("duplicate rank") {
    TrainerRank again(1, "policy");
    grpc::ClientContext c;
    v1::RegisterSourceResponse resp;
    grpc::Status s =
        d.registry->RegisterSource(&c, again.Registration(), &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::ALREADY_EXISTS);
    CHECK(Contains(s.error_message(), "source policy rank 1"));

    // replace_existing takes the rank over; the old handle is gone.
    grpc::ClientContext c2;
    v1::RegisterSourceRequest req = again.Registration();
    req.set_replace_existing(true);
    REQUIRE(d.registry->RegisterSource(&c2, req, &resp).ok());
    grpc::ClientContext c3;
    v1::HeartbeatRequest hb;
    *hb.mutable_handle() = t1.handle;
    v1::HeartbeatResponse hbr;
    CHECK(d.registry->Heartbeat(&c3, hb, &hbr).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }

  SECTION("piece outside its region") {
    TrainerRank bad(0, "other");
    v1::RegisterSourceRequest req = bad.Registration();
    req.mutable_source()->mutable_pieces(3)->set_byte_offset(4000);
    grpc::ClientContext c;
    v1::RegisterSourceResponse resp;
    grpc::Status s = d.registry->RegisterSource(&c, req, &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "source other rank 0"));
    CHECK(Contains(s.error_message(), "model.layers.0.mlp.down_proj.weight"));
    CHECK(Contains(s.error_message(), "[0:8, 0:8]"));
    CHECK(Contains(s.error_message(), "past the end of region 0 (4096 bytes)"));
  }

  SECTION("box outside its parameter, unknown dtype, bad names") {
    TrainerRank bad(0, "other");
    v1::RegisterSourceRequest req = bad.Registration();
    req.mutable_source()->mutable_pieces(0)->mutable_box()->set_offset(0, 6);
    grpc::ClientContext c;
    v1::RegisterSourceResponse resp;
    grpc::Status s = d.registry->RegisterSource(&c, req, &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "q_proj"));

    req = bad.Registration();
    req.mutable_source()->mutable_parameters(2)->set_dtype(v1::DTYPE_UNSPECIFIED);
    grpc::ClientContext c2;
    s = d.registry->RegisterSource(&c2, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "v_proj"));

    req = bad.Registration();
    req.mutable_source()->set_stream("no spaces/allowed");
    grpc::ClientContext c3;
    s = d.registry->RegisterSource(&c3, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "source.stream"));

    req = bad.Registration();
    req.mutable_source()->mutable_regions(0)->mutable_shared_memory()
        ->set_shm_name("/ferry-no-such-region");
    grpc::ClientContext c4;
    s = d.registry->RegisterSource(&c4, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "region 0"));
  }

  SECTION("declarations that disagree between ranks") {
    TrainerRank other(0, "policy");
    v1::RegisterSourceRequest req = other.Registration();
    req.set_replace_existing(true);
    req.mutable_source()->mutable_parameters(4)->set_dtype(v1::DTYPE_BF16);
    grpc::ClientContext c;
    v1::RegisterSourceResponse resp;
    grpc::Status s = d.registry->RegisterSource(&c, req, &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "model.norm.weight"));
    CHECK(Contains(s.error_message(), "rank 1"));
  }

  SECTION("a destination naming a parameter the stream does not declare") {
    EngineRank e("r0", 0, "policy");
    v1::RegisterDestinationRequest req = e.Registration();
    req.mutable_destination()->mutable_engine_table()->mutable_parameters(0)
        ->mutable_fused_parts(1)->set_checkpoint_name("model.nope.weight");
    grpc::ClientContext c;
    v1::RegisterDestinationResponse resp;
    grpc::Status s = d.registry->RegisterDestination(&c, req, &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "instance r0 tp rank 0"));
    CHECK(Contains(s.error_message(), "model.nope.weight"));
  }

  SECTION("FP8 declarations that are garbage are INVALID_ARGUMENT naming "
          "the parameter, and ferryd goes on") {
    EngineRank e("r0", 0, "policy");
    const std::string down = TestModel()[3].name;
    auto refused = [&](const std::function<void(v1::EngineParameter*)>& edit,
                       const std::string& says) {
      v1::RegisterDestinationRequest req = e.Registration();
      v1::EngineParameter* p =
          req.mutable_destination()->mutable_engine_table()->mutable_parameters(1);
      REQUIRE(p->name() == down);
      edit(p);
      grpc::ClientContext c;
      v1::RegisterDestinationResponse resp;
      grpc::Status s = d.registry->RegisterDestination(&c, req, &resp);
      INFO(s.error_message());
      CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
      CHECK(Contains(s.error_message(), says));
    };
    auto fp8 = [&](v1::EngineParameter* p, const std::string& scale) {
      p->set_dtype(v1::DTYPE_F8_E4M3);
      p->mutable_fp8()->set_scale_parameter(scale);
    };
    refused([&](v1::EngineParameter* p) { fp8(p, std::string(5000, 's')); },
            "fp8.scale_parameter");
    refused([&](v1::EngineParameter* p) {
      fp8(p, TestModel()[4].name);
      p->mutable_fp8()->set_block_rows(-5);
    }, "block -5x128 is not in [1, 1048576]");
    refused([&](v1::EngineParameter* p) {
      fp8(p, TestModel()[4].name);
      p->mutable_fp8()->set_block_cols(int64_t{1} << 40);
    }, "is not in [1, 1048576] each way");
    refused([&](v1::EngineParameter* p) { fp8(p, down); },
            "its scale tensor " + down + " is the weight itself");
    refused([&](v1::EngineParameter* p) {
      p->mutable_fp8()->set_scale_parameter(TestModel()[4].name);
    }, "engine parameter " + down + " (FP8, scales in " + TestModel()[4].name +
       "): its dtype is f32");
    refused([&](v1::EngineParameter* p) { fp8(p, TestModel()[4].name); },
            "its scale tensor " + TestModel()[4].name + " has shape [8]");
    // The daemon serves on: the same rank registers as it should.
    RegisterDestination(d, e);
  }

  SECTION("a duplicate TP rank, an instance id on another stream") {
    EngineRank e0("r0", 0, "policy"), dup("r0", 0, "policy");
    RegisterDestination(d, e0);
    grpc::ClientContext c;
    v1::RegisterDestinationResponse resp;
    grpc::Status s =
        d.registry->RegisterDestination(&c, dup.Registration(), &resp);
    CHECK(s.error_code() == grpc::StatusCode::ALREADY_EXISTS);
    CHECK(Contains(s.error_message(), "instance r0 tp rank 0"));
    EngineRank elsewhere("r0", 1, "critic");
    grpc::ClientContext c2;
    s = d.registry->RegisterDestination(&c2, elsewhere.Registration(), &resp);
    CHECK(s.error_code() == grpc::StatusCode::ALREADY_EXISTS);
    CHECK(Contains(s.error_message(), "stream policy"));
  }

  SECTION("unknown stream, unknown instance, wrong token") {
    grpc::ClientContext c;
    v1::WaitForVersionRequest w;
    w.set_stream("nope");
    w.set_version(1);
    w.set_timeout_ms(100);
    v1::WaitForVersionResponse wr;
    grpc::Status s = d.versions->WaitForVersion(&c, w, &wr);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK(Contains(s.error_message(), "stream nope"));

    grpc::ClientContext c2;
    v1::ListStreamsRequest ls;
    ls.set_stream("nope");
    v1::ListStreamsResponse lr;
    CHECK(d.inspection->ListStreams(&c2, ls, &lr).error_code() ==
          grpc::StatusCode::NOT_FOUND);

    grpc::ClientContext c3;
    v1::ExplainPlanRequest ep;
    ep.set_instance_id("ghost");
    v1::ExplainPlanResponse er;
    s = d.inspection->ExplainPlan(&c3, ep, &er);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK(Contains(s.error_message(), "ghost"));

    grpc::ClientContext c4;
    v1::HeartbeatRequest hb;
    *hb.mutable_handle() = t0.handle;
    hb.mutable_handle()->set_token("forged");
    v1::HeartbeatResponse hr;
    CHECK(d.registry->Heartbeat(&c4, hb, &hr).error_code() ==
          grpc::StatusCode::PERMISSION_DENIED);

    grpc::ClientContext c5;
    v1::GetProgressRequest gp;
    gp.set_stream("policy");
    v1::GetProgressResponse gr;
    CHECK(d.inspection->GetProgress(&c5, gp, &gr).error_code() ==
          grpc::StatusCode::NOT_FOUND);
  }

  SECTION("acks that do not match their event") {
    std::vector<std::unique_ptr<EngineRank>> ranks;
    for (int r = 0; r < 4; ++r) {
      ranks.push_back(std::make_unique<EngineRank>("r0", r, "policy"));
      RegisterDestination(d, *ranks.back());
    }
    // A source handle cannot subscribe or ack.
    grpc::ClientContext c0;
    v1::AckRequest ack;
    *ack.mutable_handle() = t0.handle;
    ack.set_event_id(1);
    ack.set_version(1);
    ack.set_kind(v1::UPDATE_EVENT_KIND_PREPARE);
    ack.set_status(v1::ACK_STATUS_OK);
    v1::AckResponse ar;
    CHECK(d.versions->Ack(&c0, ack, &ar).error_code() ==
          grpc::StatusCode::FAILED_PRECONDITION);

    // Begin version 1 (rank 0 only); r0's ranks get PREPARE as event 1.
    grpc::ClientContext c1;
    v1::BeginVersionRequest begin;
    *begin.mutable_handle() = t0.handle;
    begin.set_version(1);
    v1::BeginVersionResponse br;
    REQUIRE(d.versions->BeginVersion(&c1, begin, &br).ok());
    REQUIRE(br.instance_ids_size() == 1);

    *ack.mutable_handle() = ranks[0]->handle;
    ack.set_version(99);  // an unknown version
    grpc::ClientContext c2;
    grpc::Status s = d.versions->Ack(&c2, ack, &ar);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "instance r0 tp rank 0"));
    CHECK(Contains(s.error_message(), "version 99"));

    ack.set_event_id(12345);
    ack.set_version(1);
    grpc::ClientContext c3;
    s = d.versions->Ack(&c3, ack, &ar);
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(s.error_message(), "event 12345"));

    ack.set_event_id(1);
    grpc::ClientContext c4;
    CHECK(d.versions->Ack(&c4, ack, &ar).ok());
    grpc::ClientContext c5;
    CHECK(d.versions->Ack(&c5, ack, &ar).ok());  // idempotent

    // A second version while 1 is in progress; a version that does not
    // increase.
    grpc::ClientContext c6;
    begin.set_version(2);
    s = d.versions->BeginVersion(&c6, begin, &br);
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(Contains(s.error_message(), "version 1 is in progress"));

    grpc::ClientContext c7;
    v1::AbortVersionRequest abort;
    *abort.mutable_handle() = t0.handle;
    abort.set_version(1);
    abort.set_reason("test gives up");
    v1::AbortVersionResponse abr;
    REQUIRE(d.versions->AbortVersion(&c7, abort, &abr).ok());
    REQUIRE(abr.instances_size() == 1);
    CHECK(abr.instances(0).state() == v1::INSTANCE_STATE_ABORTED);

    grpc::ClientContext c8;
    begin.set_version(1);
    s = d.versions->BeginVersion(&c8, begin, &br);
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(Contains(s.error_message(), "never reused"));

    // An ack after the abort: ABORTED.
    ack.set_event_id(1);
    *ack.mutable_handle() = ranks[1]->handle;
    grpc::ClientContext c9;
    s = d.versions->Ack(&c9, ack, &ar);
    CHECK(s.error_code() == grpc::StatusCode::ABORTED);
    CHECK(Contains(s.error_message(), "test gives up"));
  }

  SECTION("AckBatch answers each ack on its own, in order") {
    std::vector<std::unique_ptr<EngineRank>> ranks;
    for (int r = 0; r < 4; ++r) {
      ranks.push_back(std::make_unique<EngineRank>("b0", r, "policy"));
      RegisterDestination(d, *ranks.back());
    }
    grpc::ClientContext c1;
    v1::BeginVersionRequest begin;
    *begin.mutable_handle() = t0.handle;
    begin.set_version(1);
    v1::BeginVersionResponse br;
    REQUIRE(d.versions->BeginVersion(&c1, begin, &br).ok());

    v1::AckRequest ok;  // rank 0's PREPARE, event 1
    *ok.mutable_handle() = ranks[0]->handle;
    ok.set_event_id(1);
    ok.set_version(1);
    ok.set_kind(v1::UPDATE_EVENT_KIND_PREPARE);
    ok.set_status(v1::ACK_STATUS_OK);
    v1::AckBatchRequest batch;
    *batch.add_acks() = ok;
    v1::AckRequest unknown = ok;  // rank 1, an event never sent
    *unknown.mutable_handle() = ranks[1]->handle;
    unknown.set_event_id(999);
    *batch.add_acks() = unknown;
    v1::AckRequest forged = ok;
    *forged.mutable_handle() = ranks[2]->handle;
    forged.mutable_handle()->set_token("forged");
    *batch.add_acks() = forged;
    v1::AckRequest long_reason = ok;
    *long_reason.mutable_handle() = ranks[3]->handle;
    long_reason.set_status(v1::ACK_STATUS_FAILED);
    long_reason.set_error_message(std::string(5000, 'x'));
    *batch.add_acks() = long_reason;

    grpc::ClientContext c2;
    v1::AckBatchResponse resp;
    grpc::Status s = d.versions->AckBatch(&c2, batch, &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
    REQUIRE(resp.outcomes_size() == 4);
    CHECK(resp.outcomes(0).code() == 0);
    CHECK(resp.outcomes(1).code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(resp.outcomes(1).message(), "event 999"));
    CHECK(resp.outcomes(2).code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(resp.outcomes(3).code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Contains(resp.outcomes(3).message(), "error_message"));
    // The good one took effect: the same event acked FAILED now is refused.
    ok.set_status(v1::ACK_STATUS_FAILED);
    ok.set_error_message("changed its mind");
    grpc::ClientContext c3;
    v1::AckResponse ar;
    s = d.versions->Ack(&c3, ok, &ar);
    CHECK(s.error_code() == grpc::StatusCode::FAILED_PRECONDITION);
    CHECK(Contains(s.error_message(), "already acked"));

    grpc::ClientContext c4;
    v1::AckBatchRequest empty;
    CHECK(d.versions->AckBatch(&c4, empty, &resp).error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    v1::AckBatchRequest too_many;
    for (int i = 0; i < 4097; ++i) *too_many.add_acks() = unknown;
    grpc::ClientContext c5;
    s = d.versions->AckBatch(&c5, too_many, &resp);
    CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(Contains(s.error_message(), "4097"));
  }

  SECTION("HeartbeatBatch answers each heartbeat on its own, in order") {
    EngineRank r0("hb", 0, "policy");
    RegisterDestination(d, r0);
    v1::HeartbeatBatchRequest batch;
    *batch.add_heartbeats()->mutable_handle() = t0.handle;
    v1::ParticipantHandle forged = r0.handle;
    forged.set_token("forged");
    *batch.add_heartbeats()->mutable_handle() = forged;
    v1::ParticipantHandle unknown = r0.handle;
    unknown.set_participant_id("no-such-participant");
    *batch.add_heartbeats()->mutable_handle() = unknown;
    *batch.add_heartbeats()->mutable_handle() = r0.handle;

    grpc::ClientContext c1;
    v1::HeartbeatBatchResponse resp;
    grpc::Status s = d.registry->HeartbeatBatch(&c1, batch, &resp);
    INFO(s.error_message());
    REQUIRE(s.ok());
    REQUIRE(resp.outcomes_size() == 4);
    CHECK(resp.outcomes(0).code() == 0);
    CHECK(resp.outcomes(0).lease_duration_ms() > 0);
    CHECK(resp.outcomes(1).code() == grpc::StatusCode::PERMISSION_DENIED);
    CHECK(resp.outcomes(1).lease_duration_ms() == 0);
    CHECK(resp.outcomes(2).code() == grpc::StatusCode::NOT_FOUND);
    CHECK(Contains(resp.outcomes(2).message(), "no-such-participant"));
    CHECK(resp.outcomes(3).code() == 0);

    grpc::ClientContext c2;
    v1::HeartbeatBatchRequest empty;
    CHECK(d.registry->HeartbeatBatch(&c2, empty, &resp).error_code() ==
          grpc::StatusCode::INVALID_ARGUMENT);
    v1::HeartbeatBatchRequest too_many;
    for (int i = 0; i < 4097; ++i) {
      *too_many.add_heartbeats()->mutable_handle() = r0.handle;
    }
    grpc::ClientContext c3;
    s = d.registry->HeartbeatBatch(&c3, too_many, &resp);
    CHECK(s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(Contains(s.error_message(), "4097"));
  }

  SECTION("adapter calls on an unknown instance are NOT_FOUND, naming it") {
    grpc::ClientContext c;
    v1::LoadAdapterRequest req;
    req.set_instance_id("no-such-instance");
    req.set_adapter_name("sql");
    req.set_adapter_stream("lora");
    req.set_adapter_config_json("{}");
    v1::LoadAdapterResponse resp;
    grpc::Status s = d.lifecycle->LoadAdapter(&c, req, &resp);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK(Contains(s.error_message(), "no-such-instance"));
    grpc::ClientContext c2;
    v1::UnloadAdapterRequest unload;
    unload.set_instance_id("no-such-instance");
    unload.set_adapter_name("sql");
    v1::UnloadAdapterResponse unloaded;
    s = d.lifecycle->UnloadAdapter(&c2, unload, &unloaded);
    CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
  }
}

TEST_CASE("an expired lease removes the participant", "[daemon][lease]") {
  // Leases read a ManualClock: a lease of a minute runs out when the test
  // moves the clock past it, not after a minute of waiting. The reaper
  // thread still looks every 20 ms of real time; where the test needs a
  // sweep to have happened at a given clock time it runs one itself
  // (Registry::ReapExpired, the sweep the thread runs), so what it sees
  // does not depend on when the thread was scheduled.
  ManualClock clock;
  DaemonOptions options;
  options.lease_ms = 60000;
  options.reaper_interval_ms = 20;
  options.clock = &clock;
  TestDaemon d(options);
  TrainerRank t0(0, "policy"), t1(1, "policy");
  RegisterSource(d, t0);
  RegisterSource(d, t1);
  auto participants = [&] {
    grpc::ClientContext c;
    v1::ListParticipantsResponse parts;
    REQUIRE(d.inspection->ListParticipants(&c, {}, &parts).ok());
    return parts;
  };
  auto heartbeat = [&](const v1::ParticipantHandle& h) {
    grpc::ClientContext c;
    v1::HeartbeatRequest hb;
    *hb.mutable_handle() = h;
    v1::HeartbeatResponse hr;
    grpc::Status s = d.registry->Heartbeat(&c, hb, &hr);
    if (s.ok()) CHECK(hr.lease_duration_ms() == 60000);
    return s;
  };
  Registry* registry = d.server->registry();
  REQUIRE(registry != nullptr);
  // Just short of the lease nobody expires: a sweep at 59 s keeps both,
  // each with exactly the second it has left.
  clock.Advance(absl::Seconds(59));
  registry->ReapExpired();
  CHECK(participants().participants_size() == 2);
  CHECK(registry->LeaseRemaining(t0.handle.participant_id()) ==
        absl::Seconds(1));
  CHECK(registry->LeaseRemaining(t1.handle.participant_id()) ==
        absl::Seconds(1));
  // t0 keeps heartbeating, every 20 s of clock time; t1 goes silent.
  for (int i = 0; i < 6; ++i) {
    REQUIRE(heartbeat(t0.handle).ok());
    clock.Advance(absl::Seconds(20));
  }
  // The reaper thread removes t1 on its own ...
  CHECK(Eventually([&] { return participants().participants_size() == 1; },
                   absl::Seconds(10)));
  // ... and a sweep at the final clock time (t0's last heartbeat 20 s ago)
  // keeps t0, whenever the thread last ran.
  registry->ReapExpired();
  const v1::ListParticipantsResponse parts = participants();
  REQUIRE(parts.participants_size() == 1);
  CHECK(parts.participants(0).participant_id() == t0.handle.participant_id());
  const grpc::Status s = heartbeat(t1.handle);
  CHECK(s.error_code() == grpc::StatusCode::NOT_FOUND);
  CHECK(Contains(s.error_message(), "register again"));
}

TEST_CASE("the unix socket is private", "[daemon][socket]") {
  TestDaemon d;
  struct stat st;
  REQUIRE(::stat(d.options.socket_path.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  REQUIRE(::stat((d.dir + "/run").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  grpc::ClientContext c;
  v1::GetHealthRequest req;
  v1::GetHealthResponse resp;
  REQUIRE(d.inspection->GetHealth(&c, req, &resp).ok());
  CHECK(resp.role() == v1::DAEMON_ROLE_COORDINATOR);
}

}  // namespace testing
}  // namespace ferry
