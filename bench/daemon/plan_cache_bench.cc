// plan_cache_bench: what planning a stream costs ferryd itself, not only
// the planner (bench/plan_bench.cc times ResolveDestinationLayout once and
// PlanTransfers with relays once).
//
// Builds the registrations a Kimi-K2 run sends (every trainer rank's
// pieces, every engine rank's table, as the clients put them on the wire),
// parses them as RegistryService does (memory not mapped: nothing here is
// a client's memory), adds them to a Registry, and times BuildStreamPlan on
// its snapshot, the PlanCache's work on every membership change: each
// instance's table resolved and validated, the plan with relays, and the
// sources' index kept for failovers. Wall-clock time (planning runs its
// per-rank steps on up to PlanningThreads() threads) with the CPU time of
// all threads beside it, cold (first build) and warm (second, the heap
// reused), and the process's peak RSS; then the first failover (one
// relayed replica planned from the sources). Parsing and Registry::Add are
// CPU time of the one thread that does them.
//
//   bazel run -c opt //bench/daemon:plan_cache_bench -- [--layers=61]
#include <malloc.h>
#include <sys/resource.h>

#include <cstdio>
#include <ctime>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/clocks.h"
#include "core/models/engine_layout.h"
#include "core/parallel_for.h"
#include "core/models/trainer_layout.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/registration_parser.h"
#include "daemon/registry/registry.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "proto/convert.h"
#include "tools/model_args.h"
#include "common/flags_help.h"

DEFINE_string(model, "kimi-k2-instruct", "model file in shared/models");
DEFINE_string(trainer, "tp=8,pp=8,dp=4,ep=32", "trainer parallelism");
DEFINE_string(engine, "tp=16", "engine parallelism");
DEFINE_int32(replicas, 8, "engine instances");
DEFINE_int32(layers, 61, "layers of the model to keep");
DEFINE_int32(planning_threads, 0,
             "threads that plan (0: the default, the CPUs up to 8; 1: one)");
DEFINE_int32(extra_rounds, 0,
             "warm builds after the two timed ones (for a profiler)");
DEFINE_bool(nodes, false,
            "place ranks as ferry_plan --cluster does (trainer rank r on "
            "train-<r/8>, replica k's rank r on infer-<(k*tp+r)/8>) instead "
            "of all on one node (the digests printed then differ)");
DEFINE_bool(exchange, false,
            "plan as ferryd --exchange does (core/exchange.h): replicas "
            "that read alike exchange the busiest trainer ranks' buckets");
DEFINE_bool(declaration_cache, true,
            "parse trainer ranks' declarations through the registry's "
            "DeclarationCache, as ferryd does (false: each on its own)");

namespace ferry {
namespace {

using bench::ProcessCpuMs;
using bench::ThreadCpuMs;
using bench::WallMs;

long PeakMiB() {
  struct rusage u;
  getrusage(RUSAGE_SELF, &u);
  return u.ru_maxrss / 1024;
}

[[noreturn]] void Die(const absl::Status& s) {
  std::fprintf(stderr, "%s\n", s.ToString().c_str());
  std::exit(2);
}

// One region per buffer, ids 0..n-1, as the clients register them.
void AddRegions(const std::vector<int64_t>& sizes, const std::string& name,
                google::protobuf::RepeatedPtrField<v1::MemoryRegion>* out) {
  for (size_t b = 0; b < sizes.size(); ++b) {
    v1::MemoryRegion* r = out->Add();
    r->set_region_id(static_cast<uint32_t>(b));
    r->set_size_bytes(sizes[b]);
    r->mutable_shared_memory()->set_shm_name(absl::StrCat("/", name, ".", b));
  }
}

int Main() {
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  auto full = LoadNamedModelSchema(FLAGS_model);
  if (!full.ok()) Die(full.status());
  auto schema = FirstLayers(*full, FLAGS_layers);
  auto trainer = ParseTrainerSpec(FLAGS_trainer);
  auto engine = ParseEngineSpec(FLAGS_engine);
  if (!schema.ok() || !trainer.ok() || !engine.ok()) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  auto sources = BuildTrainerLayout(schema->spec, schema->config, *trainer);
  if (!sources.ok()) Die(sources.status());
  auto tables = BuildEngineTables(schema->spec, schema->config, *engine);
  if (!tables.ok()) Die(tables.status());

  const std::string node = "bench";
  const MapOptions no_mapping{/*map_memory=*/false};
  Registry registry(absl::Hours(1), absl::Hours(1), int64_t{1} << 20);
  const std::vector<v1::ParameterSpec> params = ModelSpecToProto(schema->spec);
  // Registry::Add alone (its lock, the checks against the stream, the
  // interning), summed over every rank: parsing is the caller's and runs
  // outside the registry.
  double add_ms = 0, parse_ms = 0;
  auto add = [&](std::unique_ptr<Participant> p) {
    const double t0 = ThreadCpuMs();
    auto added = registry.Add(std::move(p), false);
    add_ms += ThreadCpuMs() - t0;
    if (!added.ok()) Die(added.status());
  };
  for (const RankLayout& r : *sources) {
    v1::SourceRegistration s;
    s.set_stream("policy");
    s.set_rank(r.rank);
    s.set_world_size(static_cast<int32_t>(sources->size()));
    s.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    for (const v1::ParameterSpec& p : params) *s.add_parameters() = p;
    AddRegions(r.buffer_bytes, absl::StrCat("src.", r.rank), s.mutable_regions());
    for (const Piece& piece : r.pieces) {
      absl::StatusOr<v1::Piece> wire = PieceToProto(piece, schema->spec);
      if (!wire.ok()) Die(wire.status());
      *s.add_pieces() = *std::move(wire);
    }
    // Parsed as RegistryService parses it, through the registry's cache of
    // declarations.
    const double t0 = ThreadCpuMs();
    auto p = ParseSourceRegistration(
        s, FLAGS_nodes ? absl::StrCat("train-", r.rank / 8) : node, no_mapping,
        FLAGS_declaration_cache ? registry.declaration_cache() : nullptr);
    parse_ms += ThreadCpuMs() - t0;
    if (!p.ok()) Die(p.status());
    add(*std::move(p));
  }
  for (int k = 0; k < FLAGS_replicas; ++k) {
    for (const EngineTable& t : *tables) {
      v1::DestinationRegistration d;
      d.set_instance_id(absl::StrCat("r", k));
      d.set_stream("policy");
      d.set_tp_rank(t.tp_rank);
      d.set_tp_size(t.tp_size);
      d.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
      AddRegions(t.buffer_bytes, absl::StrCat("dst.", k, ".", t.tp_rank),
                 d.mutable_regions());
      *d.mutable_engine_table() = EngineTableToProto(t);
      auto p = ParseDestinationRegistration(
          d,
          FLAGS_nodes
              ? absl::StrCat("infer-", (k * t.tp_size + t.tp_rank) / 8)
              : node,
          no_mapping);
      if (!p.ok()) Die(p.status());
      add(*std::move(p));
    }
  }
  absl::StatusOr<Registry::StreamSnapshot> snapshot =
      registry.Snapshot("policy");
  if (!snapshot.ok()) Die(snapshot.status());
  const long inputs_mib = PeakMiB();

  double ms[2], cpu_ms[2];
  std::shared_ptr<const StreamPlan> plan;
  PlanCacheOptions plan_options;
  plan_options.exchange = FLAGS_exchange;
  for (int round = 0; round < 2; ++round) {
    plan.reset();
    const double c0 = ProcessCpuMs();
    const double t0 = WallMs();
    plan = BuildStreamPlan(*snapshot, nullptr, plan_options);
    ms[round] = WallMs() - t0;
    cpu_ms[round] = ProcessCpuMs() - c0;
  }
  const long planned_mib = PeakMiB();
  for (int round = 0; round < FLAGS_extra_rounds; ++round) {
    plan.reset();
    plan = BuildStreamPlan(*snapshot, nullptr, plan_options);
  }
  if (!plan->source_error.empty()) {
    std::fprintf(stderr, "%s\n", plan->source_error.c_str());
    return 1;
  }
  for (const PlannedInstance& i : plan->instances) {
    if (!i.error.empty()) {
      std::fprintf(stderr, "%s\n", i.error.c_str());
      return 1;
    }
  }
  int64_t copies = 0;
  for (const InstancePlan& ip : plan->plan.instances) copies += ip.copies.size();

  // A relayed replica's copies from the sources are planned when its relay
  // fails: time the first one, then plan every replica's (what a failure
  // of every relay would follow) for the memory and a digest.
  int32_t relayed = -1;
  for (size_t k = 0; k < plan->plan.instances.size(); ++k) {
    if (plan->plan.instances[k].relay_from >= 0) {
      relayed = static_cast<int32_t>(k);
      break;
    }
  }
  double failover_ms = 0;
  if (relayed >= 0) {
    const double t0 = WallMs();
    plan->DirectPlan(relayed);
    failover_ms = WallMs() - t0;
  }
  const int32_t n = static_cast<int32_t>(plan->plan.instances.size());
  for (int32_t k = 0; k < n; ++k) plan->DirectPlan(k);
  const long failed_over_mib = PeakMiB();
  // Re-plans while the plan before is alive, as in PlanCache (it holds the
  // old plan until the new one replaces it): from scratch, and given the
  // plan before, whose tables are all resolved already (as when a replica
  // leaves or a rank registers again). Alternated twice; the second of
  // each is reported (the heap then holds a freed plan for both).
  double replan_ms[2] = {0, 0};
  for (int round = 0; round < 4; ++round) {
    const bool given = round % 2 == 1;
    const double t0 = WallMs();
    std::shared_ptr<const StreamPlan> again = BuildStreamPlan(
        *snapshot, given ? plan.get() : nullptr, plan_options);
    replan_ms[given] = WallMs() - t0;
    if (again->plan.digest != plan->plan.digest) {
      std::fprintf(stderr, "the re-plan differs from the plan\n");
      return 1;
    }
  }
  const long replanned_mib = PeakMiB();
  uint64_t direct_digest = 0;
  for (int32_t k = 0; k < n; ++k) {
    Plan one;
    one.instances.push_back(plan->DirectPlan(k));
    direct_digest = direct_digest * 1000003 ^ PlanDigest(one);
  }
  std::printf(
      "%s, %d layers: trainer %s (%zu ranks), engine %s x %d replicas, "
      "%zu tensors, %lld copies in the relay plan\n"
      "  plan digests: %016llx with relays, %016llx every replica from the "
      "sources (a change to the planner that keeps them keeps the plans)\n"
      "  BuildStreamPlan: cold %.0f ms, warm %.0f ms wall (CPU of all "
      "threads %.0f / %.0f ms, %d planning threads); peak RSS %ld MiB "
      "(registrations alone: %ld MiB)\n"
      "  re-plan while the plan before is alive: from scratch %.0f ms, "
      "given the plan before (tables resolved already) %.0f ms; peak RSS "
      "with two plans alive %ld MiB\n"
      "  first failover (DirectPlan of a relayed replica): %.0f ms; peak "
      "RSS once every replica's is planned: %ld MiB\n"
      "  Registry::Add, all %zu ranks: %.0f ms; ParseSourceRegistration, "
      "all %zu trainer ranks: %.0f ms\n",
      schema->name.c_str(), FLAGS_layers, FLAGS_trainer.c_str(),
      sources->size(), FLAGS_engine.c_str(), FLAGS_replicas,
      schema->spec.params.size(), static_cast<long long>(copies),
      static_cast<unsigned long long>(plan->plan.digest),
      static_cast<unsigned long long>(direct_digest), ms[0], ms[1],
      cpu_ms[0], cpu_ms[1], PlanningThreads(), planned_mib, inputs_mib,
      replan_ms[0], replan_ms[1], replanned_mib, failover_ms, failed_over_mib,
      sources->size() + tables->size() * static_cast<size_t>(FLAGS_replicas),
      add_ms, sources->size(), parse_ms);
  if (FLAGS_exchange) {
    int given = 0;
    int64_t bytes = 0;
    for (const Exchange& e : plan->exchanges) {
      if (e.partner < 0) continue;
      ++given;
      bytes += e.bytes;
    }
    std::printf("  exchanges: %d instances are given %lld bytes in all\n",
                given, static_cast<long long>(bytes));
  }
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage("ferryd's planning of a stream (BuildStreamPlan)");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  ferry::SetPlanningThreads(FLAGS_planning_threads);
  FLAGS_minloglevel = 1;  // the plan cache logs every plan
  google::InitGoogleLogging(argv[0]);
  return ferry::Main();
}
