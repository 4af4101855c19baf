// ferryctl's views of Inspection answers (client/ferryctl/format.h).
#include <catch2/catch.hpp>

#include "client/ferryctl/format.h"

namespace ferry {
namespace {

TEST_CASE("progress line: bar, bytes, throughput, instances") {
  v1::GetProgressResponse p;
  p.set_stream("policy");
  p.set_version(3);
  p.set_bytes_moved(int64_t{512} << 20);
  p.set_bytes_total(int64_t{1} << 30);
  p.set_throughput_bytes_per_second(4.21e9);
  p.set_elapsed_ms(1200);
  p.set_instances_total(2);
  p.set_instances_committed(1);
  CHECK(FormatProgressLine(p, 10) ==
        "policy v3 [#####.....]  50%  512.00 MiB / 1.00 GiB  4.21 GB/s  "
        "instances 1/2 committed  1.2s");
  p.set_instances_aborted(1);
  CHECK_THAT(FormatProgressLine(p, 10), Catch::Contains(", 1 ABORTED"));
}

TEST_CASE("progress per instance: aborts, waits and relays") {
  v1::GetProgressResponse p;
  v1::InstanceProgress* a = p.add_instances();
  a->mutable_status()->set_instance_id("r0");
  a->mutable_status()->set_state(v1::INSTANCE_STATE_COMMITTED);
  v1::InstanceProgress* b = p.add_instances();
  b->mutable_status()->set_instance_id("r1");
  b->mutable_status()->set_state(v1::INSTANCE_STATE_COMMITTED);
  b->set_relayed_from("r0");
  const std::string out = FormatProgressInstances(p);
  CHECK_THAT(out, Catch::Contains("relayed from r0"));
  CHECK(out.find("relayed") == out.rfind("relayed"));  // r0 itself: not
  // With --exchange: the partner that gave part of the bytes.
  v1::InstanceProgress* c = p.add_instances();
  c->mutable_status()->set_instance_id("r2");
  c->mutable_status()->set_state(v1::INSTANCE_STATE_COMMITTED);
  c->set_given_by("r3");
  CHECK_THAT(FormatProgressInstances(p), Catch::Contains("part given by r3"));
}

TEST_CASE("an adapter attachment is named by its instance and adapter") {
  v1::GetProgressResponse p;
  p.set_version(3);
  v1::InstanceProgress* a = p.add_instances();
  a->mutable_status()->set_instance_id("inst-a:a1:1");
  a->mutable_status()->set_base_instance_id("inst-a");
  a->mutable_status()->set_adapter_name("a1");
  a->mutable_status()->set_state(v1::INSTANCE_STATE_ABORTED);
  a->mutable_status()->set_abort_reason("tp rank 0 failed APPLY");
  CHECK(InstanceLabel(a->status()) == "inst-a adapter a1");
  CHECK(InstanceLabel(v1::InstanceStatus()) == "");
  const std::string out = FormatProgressInstances(p);
  CHECK_THAT(out, Catch::Contains("inst-a adapter a1"));
  CHECK(out.find("inst-a:a1:1") == std::string::npos);
  v1::ListVersionsResponse versions;
  *versions.add_versions() = p;
  CHECK_THAT(FormatVersions(versions),
             Catch::Contains("inst-a adapter a1 aborted: tp rank 0"));
}

TEST_CASE("watch and versions: what came as patches (delta versions)") {
  v1::GetProgressResponse p;
  p.set_version(7);
  p.set_instances_total(1);
  p.set_instances_committed(1);
  v1::InstanceProgress* i = p.add_instances();
  i->mutable_status()->set_instance_id("vllm-0");
  i->mutable_status()->set_state(v1::INSTANCE_STATE_COMMITTED);
  i->set_bytes_moved(int64_t{100} << 20);
  i->set_bytes_total(int64_t{100} << 20);
  CHECK_THAT(FormatProgressInstances(p), !Catch::Contains("patches"));
  i->set_patched_bytes(int64_t{40} << 20);
  i->set_patch_bytes(int64_t{3} << 20);
  i->set_changed_bytes(int64_t{2} << 20);
  CHECK_THAT(FormatProgressInstances(p),
             Catch::Contains("40.00 MiB as patches, 3.00 MiB on the wire, "
                             "5.0% changed"));
  v1::ListVersionsResponse versions;
  *versions.add_versions() = p;
  CHECK_THAT(FormatVersions(versions),
             Catch::Contains("\n         40.00 MiB as patches"));
}

TEST_CASE("streams: instances with their state and what they wait for") {
  v1::ListStreamsResponse r;
  v1::StreamInfo* s = r.add_streams();
  s->set_name("policy");
  s->set_world_size(2);
  s->add_registered_ranks(0);
  s->set_parameter_count(56);
  s->set_model_bytes(int64_t{3} << 20);
  s->set_version_in_progress(4);
  s->set_latest_committed_version(3);
  v1::InstanceInfo* i = s->add_instances();
  i->set_instance_id("vllm-0");
  i->set_tp_size(2);
  i->add_registered_tp_ranks(0);
  i->add_registered_tp_ranks(1);
  i->mutable_status()->set_state(v1::INSTANCE_STATE_ABORTED);
  i->mutable_status()->set_dirty(true);
  i->mutable_status()->set_version(4);
  i->mutable_status()->set_committed_version(3);
  i->mutable_status()->set_abort_reason("tp rank 1 did not ack PAUSE");
  const std::string out = FormatStreams(r);
  CHECK_THAT(out, Catch::StartsWith(
                      "stream policy: 1/2 source ranks (INCOMPLETE), 56 "
                      "parameters, 3.00 MiB; latest committed v3; in "
                      "progress: v4\n"));
  CHECK_THAT(out, Catch::Contains("ABORTED (dirty)"));
  CHECK_THAT(out, Catch::Contains("tp rank 1 did not ack PAUSE"));
  CHECK(FormatStreams(v1::ListStreamsResponse()) == "no streams registered\n");
}

TEST_CASE("streams and watch: a peer delivery and why an instance waits") {
  v1::ListStreamsResponse r;
  v1::StreamInfo* s = r.add_streams();
  s->set_name("policy");
  s->set_world_size(1);
  s->add_registered_ranks(0);
  s->set_latest_committed_version(3);
  v1::InstanceInfo* i = s->add_instances();
  i->set_instance_id("late");
  i->set_tp_size(1);
  i->add_registered_tp_ranks(0);
  i->mutable_status()->set_state(v1::INSTANCE_STATE_IDLE);
  i->mutable_status()->set_waiting_reason(
      "behind the stream's latest committed version 3; no instance holds "
      "version 3 and can serve as a peer");
  v1::PeerDelivery* d = s->mutable_delivery();
  d->set_kind("bootstrap");
  d->set_instance_id("b");
  d->set_peer_instance_id("a");
  d->set_version(3);
  d->set_bytes_moved(int64_t{1} << 29);
  d->set_bytes_total(int64_t{1} << 30);
  d->set_throughput_bytes_per_second(2.5e9);
  d->set_elapsed_ms(200);
  d->mutable_status()->set_state(v1::INSTANCE_STATE_TRANSFER);
  const std::string out = FormatStreams(r);
  CHECK_THAT(out, Catch::Contains("no instance holds version 3"));
  CHECK_THAT(out, Catch::Contains(
                      "  bootstrap b <- a v3 [##########..........]  50%  "
                      "512.00 MiB / 1.00 GiB  2.50 GB/s  TRANSFER  200ms\n"));
  d->set_settled(true);
  d->mutable_status()->set_state(v1::INSTANCE_STATE_ABORTED);
  d->mutable_status()->set_abort_reason("peer instance a tp rank 1 lost");
  CHECK_THAT(FormatStreams(r), Catch::Contains("  last bootstrap b <- a v3"));
  CHECK_THAT(FormatDelivery(*d, 10),
             Catch::EndsWith(": peer instance a tp rank 1 lost"));
}

TEST_CASE("config: every option, sorted") {
  google::protobuf::Map<std::string, std::string> options;
  options["serve_as_peer"] = "true";
  options["load_format"] = "fallback_only";
  CHECK(FormatConfig("b", options) ==
        "instance b load options:\n  load_format = fallback_only\n"
        "  serve_as_peer = true\n");
}

TEST_CASE("plan: totals, gaps and a bounded parameter list") {
  v1::ExplainPlanResponse r;
  r.set_stream("policy");
  r.set_instance_id("vllm-0");
  r.set_plan_digest("0123456789abcdef0123");
  r.mutable_totals()->set_total_bytes(1000);
  r.mutable_totals()->set_direct_bytes(750);
  r.mutable_totals()->set_fallback_bytes(250);
  r.mutable_totals()->set_direct_byte_coverage(0.75);
  for (int k = 0; k < 3; ++k) {
    v1::ParameterPlan* p = r.add_parameters();
    p->set_name("model.layers." + std::to_string(k) + ".mlp.gate_up_proj.weight");
    p->set_resolution(v1::RESOLUTION_FUSED);
    p->set_reason("fused gate_proj, up_proj along dim 0");
    p->set_bytes(250);
    p->add_source_ranks(0);
    p->add_source_ranks(1);
  }
  v1::CoverageGap* g = r.add_gaps();
  g->set_tp_rank(1);
  g->set_parameter("lm_head.weight");
  g->mutable_box()->add_offset(0);
  g->mutable_box()->add_extent(64);
  const std::string out = FormatPlan(r, 2);
  CHECK_THAT(out, Catch::StartsWith("instance vllm-0 (stream policy)  plan "
                                    "0123456789abcdef\n"));
  CHECK_THAT(out, Catch::Contains("direct coverage  75.0%"));
  CHECK_THAT(out, Catch::Contains("tp rank 1: lm_head.weight [0:64]"));
  CHECK_THAT(out, Catch::Contains("fused"));
  CHECK_THAT(out, Catch::Contains("r0,1"));
  CHECK_THAT(out, Catch::Contains("... 1 more (use --all)"));
  CHECK_THAT(FormatPlan(r, 0), !Catch::Contains("more (use --all)"));
  CHECK_THAT(out, !Catch::Contains("exchange"));
  r.set_exchange_partner("vllm-1");
  r.set_exchanged_bytes(300);
  CHECK_THAT(FormatPlan(r, 2),
             Catch::Contains("exchange         300 B given by vllm-1 each "
                             "version (the rest from the trainer)\n"));
}

TEST_CASE("health names problems") {
  v1::GetHealthResponse h;
  h.set_node("node-a");
  h.set_role(v1::DAEMON_ROLE_COORDINATOR);
  h.set_uptime_ms(125000);
  CHECK_THAT(FormatHealth(h), Catch::Contains("problems  none: healthy"));
  CHECK_THAT(FormatHealth(h), Catch::StartsWith("node node-a: coordinator, ferryd ?, up 2m05s"));
  h.add_problems("no CUDA driver: GPU transports unavailable");
  CHECK_THAT(FormatHealth(h),
             Catch::Contains("PROBLEM   no CUDA driver: GPU transports unavailable"));
}

TEST_CASE("health names the rails, its own and its peers'") {
  v1::GetHealthResponse h;
  h.set_node("node-a");
  h.set_role(v1::DAEMON_ROLE_COORDINATOR);
  CHECK_THAT(FormatHealth(h), Catch::Contains("  rails     one (no --rails)\n"));
  h.add_rails("10.1.0.5");
  h.add_rails("10.2.0.5");
  v1::PeerHealth* p = h.add_peers();
  p->set_node("node-b");
  p->set_peer_address("10.0.0.6:7433");
  p->set_reachable(true);
  p->add_rails("10.1.0.6");
  p->add_rails("10.2.0.6");
  const std::string out = FormatHealth(h);
  CHECK_THAT(out, Catch::Contains("  rails     2: 10.1.0.5, 10.2.0.5\n"));
  CHECK_THAT(out, Catch::Contains("peer      node-b 10.0.0.6:7433 reachable, "
                                  "last heartbeat 0ms ago, 2 rails\n"));
}

TEST_CASE("verify: summary, one line per mismatch, unverified by reason") {
  v1::VerifyInstanceResponse r;
  r.set_instance_id("vllm-0");
  r.set_version(3);
  r.set_parameters_checked(1234);
  r.set_bytes_checked(int64_t{1717986918});  // 1.6 GiB
  CHECK(FormatVerify(r, 3) ==
        "instance vllm-0 at version 3: 1234 parameters, 1.60 GiB checked, "
        "0 mismatches\n");

  v1::ChecksumMismatch* m = r.add_mismatches();
  m->set_parameter("model.layers.0.mlp.down_proj.weight");
  m->set_tp_rank(2);
  m->mutable_box()->add_offset(0);
  m->mutable_box()->add_offset(8);
  m->mutable_box()->add_extent(8);
  m->mutable_box()->add_extent(4);
  m->set_node("node-b");
  m->set_expected(0x0123456789abcdefULL);
  m->set_actual(0xfedcba9876543210ULL);
  for (int rank = 0; rank < 2; ++rank) {
    for (const char* p : {"lm_head.weight", "a.weight", "b.weight", "c.weight"}) {
      v1::UnverifiedParameter* u = r.add_unverifiable();
      u->set_parameter(p);
      u->set_tp_rank(rank);
      u->set_reason("not verifiable (fallback): staging");
      u->set_bytes(1024);
    }
  }
  r.set_bytes_unverifiable(8192);
  r.set_relayed_from("vllm-1");
  CHECK(FormatVerify(r, 3) ==
        "instance vllm-0 at version 3: 1234 parameters, 1.60 GiB checked, "
        "1 mismatch, 8.00 KiB not verified (relayed from vllm-1)\n"
        "  MISMATCH model.layers.0.mlp.down_proj.weight tp rank 2 box "
        "[0:8, 8:12] on node-b: expected 0123456789abcdef, found "
        "fedcba9876543210\n"
        "  8.00 KiB of 4 parameters on 2 ranks (a.weight, b.weight, "
        "c.weight, ...): not verifiable (fallback): staging\n");
}

}  // namespace
}  // namespace ferry
