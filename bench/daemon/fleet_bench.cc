// fleet_bench: what the version protocol costs at fleet size, across real
// daemons (issue 38; docs/benchmarks.md, "A fleet on one coordinator").
//
// For each --ranks size it starts a fleet on this machine
// (tests/fleet/fleet_cluster.h): a coordinator ferryd and --members member
// ferryds, joined over mutual TLS on loopback, and one fleet_ranks process
// per daemon whose threads are that node's trainer and engine ranks. The
// model is small (2 bf16 parameters [1024, 16]: 64 KiB), so what a
// version costs is the protocol's: events, acks, forwarding, planning.
//
// Per size it reports:
//   register   every rank registering at once, until the last is in;
//   first      the first version (it plans the stream);
//   version    p50 / p99 / max of --versions versions, first BeginVersion
//              to the last trainer rank's CommitVersion return, and the
//              same less the bytes' own time (the version's bytes over a
//              plain loopback TCP stream, timed in the same run): the
//              protocol overhead;
//   coord      the coordinator's CPU per version, its RSS, threads and
//              open descriptors after the versions; the members' mean
//              CPU per version.
// Every version's bytes are checked on every engine rank against the
// trainer's pattern (outside the timing). Target (issue 38): protocol p99
// under 100 ms at 1,024 ranks, growing no faster than linearly, the
// coordinator's threads and descriptors not proportional to ranks.
//
//   bazel run -c opt //bench/daemon:fleet_bench -- [--ranks=16,64,256,1024]
//       [--members=15] [--versions=20] [--ferryd=PATH]
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "bench/daemon/bench_figures.h"
#include "common/flags_help.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "tests/fleet/fleet_cluster.h"

DEFINE_string(ranks, "16,64,256,1024", "fleet sizes, in ranks");
DEFINE_int32(members, 15, "member daemons besides the coordinator");
DEFINE_int32(tp, 8, "tensor-parallel size of the engine instances");
DEFINE_int32(trainer_nodes, 0,
             "daemons holding the trainer's ranks (0: every daemon)");
DEFINE_int32(versions, 20, "measured versions per size (after the first)");
DEFINE_string(ferryd, "",
              "the ferryd binary every daemon runs (default: the one built "
              "with this benchmark); for A/B runs of two builds");
DEFINE_string(ferryd_flags, "",
              "extra ferryd flags for every daemon, comma-separated");

namespace ferry {
namespace {

// The bytes' own time, the physical limit on this machine: a raw loopback
// TCP stream of `bytes`, best of 3 (0 when it failed, logged).
double RawTcpMs(int64_t bytes) {
  std::vector<uint8_t> src(static_cast<size_t>(bytes), 1), dst(src.size());
  double best = 0;
  for (int run = 0; run < 3; ++run) {
    absl::StatusOr<double> s =
        bench::RawLoopbackSeconds(src.data(), dst.data(), bytes);
    if (!s.ok()) {
      LOG(ERROR) << s.status();
      return 0;
    }
    if (best == 0 || *s < best) best = *s;
  }
  return 1e3 * best;
}

int RunSize(int ranks) {
  testing::FleetShape shape;
  shape.ranks = ranks;
  shape.members = FLAGS_members;
  shape.tp = FLAGS_tp;
  shape.trainer_nodes = FLAGS_trainer_nodes;
  shape.ferryd = FLAGS_ferryd;
  for (absl::string_view f :
       absl::StrSplit(FLAGS_ferryd_flags, ',', absl::SkipEmpty())) {
    shape.ferryd_flags.push_back(std::string(f));
  }
  absl::StatusOr<std::unique_ptr<testing::FleetCluster>> fleet =
      testing::FleetCluster::Start(shape);
  if (!fleet.ok()) {
    LOG(ERROR) << "fleet of " << ranks << " ranks: " << fleet.status();
    return 1;
  }
  testing::FleetCluster& f = **fleet;
  const testing::ProcessStats idle = f.Stats(0);
  // While every rank registers at once: how long the coordinator takes to
  // answer GetHealth (what a lock held across the storm would block).
  std::atomic<bool> storm{true};
  std::vector<double> inspect_ms;
  std::thread inspector([&] {
    while (storm.load()) {
      auto ctx = f.coordinator().NewContext(absl::Seconds(30));
      v1::GetHealthResponse health;
      const absl::Time start = absl::Now();
      f.coordinator().inspection().GetHealth(ctx.get(), v1::GetHealthRequest(),
                                             &health);
      inspect_ms.push_back(absl::ToDoubleMilliseconds(absl::Now() - start));
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  absl::StatusOr<absl::Duration> registered =
      f.RegisterRanks(absl::Minutes(5));
  storm = false;
  inspector.join();
  if (!registered.ok()) {
    LOG(ERROR) << registered.status();
    return 1;
  }
  absl::StatusOr<testing::FleetVersion> first =
      f.Publish(1, absl::Minutes(5));
  if (!first.ok() || first->aborted != 0) {
    LOG(ERROR) << "version 1: "
               << (first.ok() ? absl::StrJoin(first->aborted_ids, ", ")
                              : first.status().ToString());
    return 1;
  }
  std::vector<double> wall_ms, protocol_ms;
  double raw_ms = 0;  // the version's bytes over a raw loopback stream
  int64_t version_bytes = 0;
  const testing::ProcessStats before = f.Stats(0);
  double members_before = 0;
  for (int d = 1; d < f.daemons(); ++d) members_before += f.Stats(d).cpu_seconds;
  for (int v = 2; v < 2 + FLAGS_versions; ++v) {
    absl::StatusOr<testing::FleetVersion> r = f.Publish(v, absl::Minutes(5));
    if (!r.ok() || r->aborted != 0) {
      LOG(ERROR) << "version " << v << ": "
                 << (r.ok() ? absl::StrJoin(r->aborted_ids, ", ")
                            : r.status().ToString());
      return 1;
    }
    absl::StatusOr<v1::GetProgressResponse> p = f.Progress(v);
    if (!p.ok()) {
      LOG(ERROR) << p.status();
      return 1;
    }
    if (raw_ms == 0) raw_ms = RawTcpMs(p->bytes_total());
    const double ms = absl::ToDoubleMilliseconds(r->wall);
    wall_ms.push_back(ms);
    protocol_ms.push_back(std::max(0.0, ms - raw_ms));
    version_bytes = p->bytes_total();
  }
  const testing::ProcessStats after = f.Stats(0);
  double members_after = 0;
  for (int d = 1; d < f.daemons(); ++d) members_after += f.Stats(d).cpu_seconds;
  // Every version's bytes, on every engine rank (the last version's: each
  // rank keeps only what it holds now).
  absl::StatusOr<int> checked =
      f.CheckBytes(1 + FLAGS_versions, absl::Minutes(1));
  if (!checked.ok()) {
    LOG(ERROR) << checked.status();
    return 1;
  }
  const int engine_ranks = f.instances() * FLAGS_tp;
  if (*checked != engine_ranks) {
    LOG(ERROR) << *checked << " of " << engine_ranks
               << " engine ranks hold the last version";
    return 1;
  }
  const double n = FLAGS_versions;
  std::printf(
      "%5d ranks (%3d trainer, %3d x TP%d) | register %7.0f ms (GetHealth "
      "max %.0f ms meanwhile) | first %6.0f "
      "ms | version p50 %6.1f p99 %6.1f max %6.1f ms | bytes %.1f MiB, "
      "%.1f ms raw | protocol p50 %6.1f p99 %6.1f ms | coord CPU %6.1f "
      "ms/version, RSS %4.0f MiB (idle %4.0f), "
      "%4d threads (idle %d), %4d fds (idle %d) | members CPU %5.1f "
      "ms/version each\n",
      ranks, f.sources(), f.instances(), FLAGS_tp,
      absl::ToDoubleMilliseconds(*registered), bench::Percentile(inspect_ms, 1.0),
      absl::ToDoubleMilliseconds(first->wall), bench::Percentile(wall_ms, 0.5),
      bench::Percentile(wall_ms, 0.99), bench::Percentile(wall_ms, 1.0),
      version_bytes / 1048576.0, raw_ms, bench::Percentile(protocol_ms, 0.5), bench::Percentile(protocol_ms, 0.99),
      1e3 * (after.cpu_seconds - before.cpu_seconds) / n,
      after.rss_bytes / 1048576.0, idle.rss_bytes / 1048576.0, after.threads,
      idle.threads, after.fds, idle.fds,
      1e3 * (members_after - members_before) / n / FLAGS_members);
  std::fflush(stdout);
  return 0;
}

int Main() {
  std::printf("fleet_bench: %d member daemons + a coordinator, %ld cores, "
              "%d versions per size; every daemon, rank process and the "
              "kernel share this machine's cores\n",
              FLAGS_members, sysconf(_SC_NPROCESSORS_ONLN), FLAGS_versions);
  for (absl::string_view r : absl::StrSplit(FLAGS_ranks, ',')) {
    int ranks = 0;
    if (!absl::SimpleAtoi(r, &ranks)) {
      LOG(ERROR) << "--ranks: " << r;
      return 1;
    }
    if (int rc = RunSize(ranks); rc != 0) return rc;
  }
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "the version protocol's cost at fleet size, across real daemons");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  return ferry::Main();
}
