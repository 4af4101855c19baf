// Planning benchmark: Kimi-K2 (about 1T parameters, 61 layers, 384 experts)
// from 256 trainer ranks (TP8 x PP8 x DP4, EP32) to TP16 inference
// instances, 8 replicas. Target: under 1 s and under 1 GiB on one core.
//
//   bazel run -c opt //bench:plan_bench [-- --model=... --layers=1,4,16,61]
//
// Each configuration runs in a forked child so that its peak memory
// (ru_maxrss from wait4) is its own. Times are wall-clock (planning runs
// its per-rank steps on up to PlanningThreads() threads), with the CPU time
// of all the process's threads beside them: run it on a quiet machine.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <malloc.h>
#include <cstdio>
#include <memory>
#include <vector>

#include <gflags/gflags.h>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/layout_resolution.h"
#include "core/parallel_for.h"
#include "bench/clocks.h"
#include "core/planner.h"
#include "tools/model_args.h"
#include "common/flags_help.h"

DEFINE_string(model, "kimi-k2-instruct", "model file in shared/models");
DEFINE_string(trainer, "tp=8,pp=8,dp=4,ep=32", "trainer parallelism");
DEFINE_string(engine, "tp=16", "engine parallelism (add ,ep for expert "
                               "parallel MoE)");
DEFINE_int32(replicas, 8, "engine instances");
DEFINE_string(layers, "1,4,16,61", "layer counts to plan, one child each");
DEFINE_int32(planning_threads, 0,
             "threads that plan (0: the default, the CPUs up to 8; 1: one)");

namespace ferry {
namespace {

using bench::ProcessCpuMs;
using bench::WallMs;

double Ms(double a, double b) { return b - a; }

long RssKiB() {
  long pages = 0, rss = 0;
  FILE* f = std::fopen("/proc/self/statm", "r");
  if (f == nullptr) return 0;
  if (std::fscanf(f, "%ld %ld", &pages, &rss) != 2) rss = 0;
  std::fclose(f);
  return rss * (sysconf(_SC_PAGESIZE) / 1024);
}

// Runs one configuration; prints one table row. Returns a process status.
int RunOne(const ModelSchema& full, int64_t layers) {
  auto schema = FirstLayers(full, layers);
  auto trainer = ParseTrainerSpec(FLAGS_trainer);
  auto engine = ParseEngineSpec(FLAGS_engine);
  if (!schema.ok() || !trainer.ok() || !engine.ok()) {
    std::fprintf(stderr, "bad arguments\n");
    return 2;
  }
  const long rss0 = RssKiB();
  auto sources = BuildTrainerLayout(schema->spec, schema->config, *trainer);
  if (!sources.ok()) {
    std::fprintf(stderr, "%s\n", std::string(sources.status().message()).c_str());
    return 2;
  }
  auto tables = BuildEngineTables(schema->spec, schema->config, *engine);
  if (!tables.ok()) {
    std::fprintf(stderr, "%s\n", std::string(tables.status().message()).c_str());
    return 2;
  }
  const long rss_inputs = RssKiB();
  // Two rounds: the first (cold) pays the kernel for every fresh page it
  // touches (about 17 us per 4 KiB page on the VMs measured here); the
  // second (warm) reuses the heap the first freed, as a daemon that
  // re-plans on membership changes does. Both are reported.
  double resolve_ms[2], plan_ms[2], cpu_ms[2];
  std::shared_ptr<std::vector<RankLayout>> layout;
  absl::StatusOr<Plan> plan;
  for (int round = 0; round < 2; ++round) {
    layout.reset();
    plan = absl::UnknownError("not planned");
    const double c0 = ProcessCpuMs();
    const double t0 = WallMs();
    auto resolved = ResolveDestinationLayout(schema->spec, *tables);
    if (!resolved.ok()) {
      std::fprintf(stderr, "%s\n", std::string(resolved.status().message()).c_str());
      return 2;
    }
    layout = std::make_shared<std::vector<RankLayout>>();
    for (ResolvedRank& r : resolved->ranks) layout->push_back(std::move(r.layout));
    std::vector<Instance> instances;
    for (int k = 0; k < FLAGS_replicas; ++k) {
      Instance inst;
      inst.id = absl::StrCat("r", k);
      inst.layout = layout;
      for (int r = 0; r < engine->tp; ++r) {
        inst.nodes.push_back(absl::StrCat("infer-", (k * engine->tp + r) / 8));
      }
      instances.push_back(std::move(inst));
    }
    const double t1 = WallMs();
    plan = PlanTransfers(schema->spec, *sources, instances);
    const double t2 = WallMs();
    cpu_ms[round] = ProcessCpuMs() - c0;
    if (!plan.ok()) {
      std::fprintf(stderr, "%s\n", std::string(plan.status().message()).c_str());
      return 2;
    }
    resolve_ms[round] = Ms(t0, t1);
    plan_ms[round] = Ms(t1, t2);
  }
  int64_t pieces = 0, copies = 0, buckets = 0;
  for (const RankLayout& r : *sources) pieces += r.pieces.size();
  for (const RankLayout& r : *layout) pieces += r.pieces.size();
  for (const InstancePlan& ip : plan->instances) {
    copies += ip.copies.size();
    buckets += ip.buckets.size();
  }
  std::printf(
      "%6lld %9zu %10lld %9lld %8lld %7.0f/%-5.0f %7.0f/%-5.0f %7.0f/%-5.0f "
      "%7.0f/%-5.0f %10ld %9ld %8s",
      static_cast<long long>(layers), schema->spec.params.size(),
      static_cast<long long>(pieces), static_cast<long long>(copies),
      static_cast<long long>(buckets), resolve_ms[0], resolve_ms[1],
      plan_ms[0], plan_ms[1], resolve_ms[0] + plan_ms[0],
      resolve_ms[1] + plan_ms[1], cpu_ms[0], cpu_ms[1],
      (rss_inputs - rss0) / 1024,
      (RssKiB() - rss_inputs) / 1024,
      absl::StrCat(plan->source_bytes >> 30, " GiB").c_str());
  std::fflush(stdout);
  return 0;  // the parent ends the row with the peak memory
}

int Main() {
  // Keep freed memory in the heap for the next round instead of returning
  // large blocks to the kernel (glibc would munmap them).
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, 1 << 30);
  auto full = LoadNamedModelSchema(FLAGS_model);
  if (!full.ok()) {
    std::fprintf(stderr, "%s\n", std::string(full.status().message()).c_str());
    return 2;
  }
  std::printf("model %s, trainer %s, engine %s x %d replicas (relay)\n",
              full->name.c_str(), FLAGS_trainer.c_str(), FLAGS_engine.c_str(),
              FLAGS_replicas);
  std::printf("times: wall ms, cold/warm, and CPU ms of all threads (see "
              "the comment in RunOne); planning threads: %d\n",
              PlanningThreads());
  std::printf("%6s %9s %10s %9s %8s %13s %13s %13s %13s %10s %9s %8s %9s\n",
              "layers", "tensors", "pieces", "copies", "buckets",
              "resolve_ms", "plan_ms", "total_ms", "cpu_ms", "inputs_MiB",
              "plan_MiB", "sent", "peak_MiB");
  for (absl::string_view l : absl::StrSplit(FLAGS_layers, ',')) {
    int64_t layers = 0;
    if (!absl::SimpleAtoi(l, &layers)) return 2;
    std::fflush(stdout);
    const pid_t child = fork();
    if (child == 0) _exit(RunOne(*full, layers));
    int status = 0;
    struct rusage usage;
    wait4(child, &status, 0, &usage);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 1;
    // ru_maxrss of the child includes the model schema it inherited.
    std::printf(" %9ld\n", usage.ru_maxrss / 1024);
  }
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage("planning benchmark (see docs/benchmarks.md)");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  ferry::SetPlanningThreads(FLAGS_planning_threads);
  return ferry::Main();
}
