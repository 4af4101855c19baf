// bootstrap_bench: what filling an instance from a peer instance costs on
// one node (docs/api.md, "Bootstrap and reload"), against what the
// machine's memory can do.
//
// Starts an in-process ferryd on a temporary unix socket; a TP1 trainer of
// the demo model (the Llama-3.1-8B tensor set scaled to ~1.6 GiB, the one
// deploy/demo.sh runs) publishes version 1 into engine instance "peer"
// (an engine table: fused qkv_proj and gate_up_proj); then:
//
//   bootstrap   instance "late" (the same engine layout) registers holding
//               version 0 and is filled from "peer": begin .. committed as
//               the daemon reports it (StreamInfo.delivery.elapsed_ms), and
//               registration .. COMMIT seen by the late rank's client.
//   reload      --reloads ReloadInPlace calls on "late" (the same delivery,
//               on demand): each call's wall time.
//
// Each against single-thread memcpy of the same bytes between the same two
// engine arenas, measured in the same run. Target: bootstrap >= 0.8x.
//
//   bazel run -c opt //bench/daemon:bootstrap_bench -- [--reloads=N]
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "bench/daemon/bench_daemon.h"
#include "bench/daemon/bench_figures.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/verifying_engine.h"
#include "client/destination_client.h"
#include "client/lifecycle_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/models/trainer_layout.h"
#include "daemon/daemon_options.h"
#include "daemon/server.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "common/flags_help.h"

DEFINE_string(scale, "demo", "demo model scale: demo (~1.6 GiB), small, tiny");
DEFINE_int32(reloads, 5, "ReloadInPlace calls measured after the bootstrap");
DEFINE_int32(copy_threads, 0, "ferryd --copy_threads (0: its default)");

namespace ferry {
namespace {

using bench::Median;
using bench::MemcpyBandwidth;

absl::StatusOr<v1::StreamInfo> Stream(const Connection& c) {
  v1::ListStreamsRequest req;
  req.set_stream("policy");
  v1::ListStreamsResponse resp;
  auto context = c.NewContext();
  grpc::Status s = c.inspection().ListStreams(context.get(), req, &resp);
  if (!s.ok() || resp.streams_size() != 1) {
    return absl::InternalError(absl::StrCat("ListStreams: ", s.error_message()));
  }
  return resp.streams(0);
}

int Main() {
  DaemonOptions options;
  options.copy_threads = FLAGS_copy_threads;
  absl::StatusOr<std::unique_ptr<bench::BenchDaemon>> daemon =
      bench::BenchDaemon::Start(options);
  if (!daemon.ok()) {
    LOG(ERROR) << daemon.status();
    return 1;
  }
  const Connection* c = &(*daemon)->connection();

  absl::StatusOr<ModelSchema> schema = LoadDemoModel("llama-3.1-8b", FLAGS_scale);
  if (!schema.ok()) {
    LOG(ERROR) << schema.status();
    return 1;
  }
  absl::StatusOr<std::vector<RankLayout>> layouts =
      BuildTrainerLayout(schema->spec, schema->config, TrainerParallelism{});
  if (!layouts.ok()) return 1;
  const RankLayout& trainer_layout = (*layouts)[0];
  auto src = SharedTensorArena::Create("bench.boot.src",
                                       trainer_layout.buffer_bytes[0], 0);
  if (!src.ok()) return 1;
  std::memset((*src)->data(), 3, trainer_layout.buffer_bytes[0]);
  SourceOptions so;
  so.stream = "policy";
  auto source = SourceClient::Register(
      *c, so,
      SourceLayout{schema->spec, trainer_layout.pieces, {(*src)->Describe()}});
  if (!source.ok()) {
    LOG(ERROR) << source.status();
    return 1;
  }
  // Engine tables and arenas as the demo engine has them; the benchmark's
  // ranks ack every event at once (no verification in the timed path).
  auto make_engine = [&](const std::string& hint) {
    return VerifyingEngine::Create(*schema, 1, 0, {}, hint);
  };
  auto peer_engine = make_engine("bench.boot.peer");
  auto late_engine = make_engine("bench.boot.late");
  if (!peer_engine.ok() || !late_engine.ok()) return 1;
  auto register_engine = [&](const std::string& id, VerifyingEngine& e) {
    DestinationOptions o;
    o.instance_id = id;
    o.stream = "policy";
    return DestinationClient::Register(
        *c, o,
        DestinationLayout::FromEngineTable(e.table(), {e.arena().Describe()}),
        DestinationCallbacks{});
  };
  auto peer = register_engine("peer", **peer_engine);
  if (!peer.ok()) return 1;
  absl::StatusOr<PublishOutcome> v1 = (*source)->PublishVersion(1);
  if (!v1.ok() || !v1->all_committed()) {
    LOG(ERROR) << "version 1 did not commit";
    return 1;
  }
  const int64_t arena_bytes = (*peer_engine)->arena().capacity();
  const double memcpy_bw =
      MemcpyBandwidth((*peer_engine)->arena().data(),
                      (*late_engine)->arena().data(), arena_bytes);

  // The trainer moves on: its memory is not read again.
  std::memset((*src)->data(), 0, trainer_layout.buffer_bytes[0]);
  const absl::Time registering = absl::Now();
  auto late = register_engine("late", **late_engine);
  if (!late.ok()) return 1;
  if (!(*late)->AwaitCommitted(1, absl::Minutes(5)).ok()) {
    LOG(ERROR) << "late instance not bootstrapped";
    return 1;
  }
  const double seen = absl::ToDoubleSeconds(absl::Now() - registering);
  absl::StatusOr<v1::StreamInfo> info = Stream(*c);
  if (!info.ok()) return 1;
  const v1::PeerDelivery d = info->delivery();
  if (d.kind() != "bootstrap" || d.bytes_moved() != d.bytes_total() ||
      std::memcmp((*peer_engine)->arena().data(), (*late_engine)->arena().data(),
                  arena_bytes) != 0) {
    LOG(ERROR) << "bootstrap did not deliver the peer's bytes: "
               << d.DebugString();
    return 1;
  }
  const double bytes = static_cast<double>(d.bytes_total());
  const double boot = d.elapsed_ms() / 1e3;

  std::vector<double> reloads;
  for (int i = 0; i < FLAGS_reloads; ++i) {
    std::memset((*late_engine)->arena().data(), 0, arena_bytes);
    const absl::Time start = absl::Now();
    absl::StatusOr<v1::InstanceStatus> s = ReloadInPlace(*c, "late");
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    if (!s.ok() || s->state() != v1::INSTANCE_STATE_COMMITTED) {
      LOG(ERROR) << "reload failed";
      return 1;
    }
    reloads.push_back(t);
  }
  if (std::memcmp((*peer_engine)->arena().data(), (*late_engine)->arena().data(),
                  arena_bytes) != 0) {
    LOG(ERROR) << "the last reload did not restore the bytes";
    return 1;
  }
  std::printf("bootstrap_bench: %ld cores online, ferryd in process, copy "
              "threads %s\n", sysconf(_SC_NPROCESSORS_ONLN),
              FLAGS_copy_threads > 0 ? absl::StrCat(FLAGS_copy_threads).c_str()
                                     : "default (min(4, cores))");
  std::printf("model: llama-3.1-8b %s, %zu parameters, %.2f GiB delivered "
              "(engine table TP1, fused qkv/gate_up, peer -> late)\n",
              FLAGS_scale.c_str(), schema->spec.params.size(),
              bytes / (1 << 30));
  std::printf("  single-thread memcpy:            %6.2f GB/s\n", memcpy_bw / 1e9);
  std::printf("  bootstrap (begin..committed):    %8.1f ms = %6.2f GB/s = "
              "%.2fx memcpy (target >= 0.8x)\n",
              boot * 1e3, bytes / boot / 1e9, bytes / boot / memcpy_bw);
  std::printf("  bootstrap (registered..COMMIT):  %8.1f ms\n", seen * 1e3);
  if (!reloads.empty()) {
    const double med = Median(reloads);
    std::printf("  reload (ReloadInPlace call):     median %8.1f ms = %6.2f "
                "GB/s = %.2fx, min %.1f ms, max %.1f ms (%d calls)\n",
                med * 1e3, bytes / med / 1e9, bytes / med / memcpy_bw,
                *std::min_element(reloads.begin(), reloads.end()) * 1e3,
                *std::max_element(reloads.begin(), reloads.end()) * 1e3,
                FLAGS_reloads);
  }
  late->reset();
  peer->reset();
  source->reset();
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage("same-node bootstrap and reload from a peer instance");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = 1;
  google::InitGoogleLogging(argv[0]);
  return ferry::Main();
}
