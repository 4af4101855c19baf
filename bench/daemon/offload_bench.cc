// offload_bench: what Lifecycle.Offload (with a host copy) and Onload cost
// on one node (docs/api.md, "Offload and onload"), against what the
// machine's memory can do.
//
// An in-process ferryd on a temporary unix socket; a TP1 trainer of the
// demo model (the Llama-3.1-8B tensor set scaled to ~1.6 GiB, the one
// deploy/demo.sh runs) publishes version 1 into engine instance "e" (the
// demo engine table). Then --rounds times:
//
//   offload   Offload(keep_host_copy): PAUSE, ferryd copies the engine's
//             arena into its own memory, OFFLOAD (the rank releases the
//             arena: SharedTensorArena::Release). The call's wall time.
//   onload    Onload: ONLOAD (the rank makes a new arena and registers it,
//             UpdateRegions; ferryd maps it), the copy written back, APPLY,
//             COMMIT. The call's wall time; the engine's bytes are compared
//             with the trainer's version after each round.
//
// Against, in the same run: single-thread memcpy of the same bytes between
// two warm arenas, and into a freshly created arena (its pages allocated by
// the copy, as an onload's are). Target: onload >= 0.8x memcpy.
//
//   bazel run -c opt //bench/daemon:offload_bench -- [--rounds=N]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/daemon/bench_daemon.h"
#include "bench/daemon/bench_figures.h"
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
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "common/flags_help.h"

DEFINE_string(scale, "demo", "demo model scale: demo (~1.6 GiB), small, tiny");
DEFINE_int32(rounds, 5, "offload + onload rounds measured");

namespace ferry {
namespace {

using bench::Median;
using bench::MemcpyBandwidth;

// Best of 3: create an arena of `bytes` and copy into it (first touch).
double FreshMemcpyBandwidth(const uint8_t* src, int64_t bytes) {
  double best = 0;
  for (int i = 0; i < 3; ++i) {
    const absl::Time start = absl::Now();
    auto fresh = SharedTensorArena::Create("bench.offload.fresh", bytes, 0);
    if (!fresh.ok()) return 0;
    std::memcpy((*fresh)->data(), src, static_cast<size_t>(bytes));
    best = std::max(best, bytes / absl::ToDoubleSeconds(absl::Now() - start));
  }
  return best;
}

void PrintTimes(const char* what, const std::vector<double>& t, double bytes,
                double memcpy_bw, double fresh_bw) {
  const double med = Median(t);
  std::printf("  %-8s median %7.1f ms = %5.2f GB/s = %.2fx memcpy, %.2fx "
              "fresh memcpy; min %.1f ms, max %.1f ms (%zu rounds)\n",
              what, med * 1e3, bytes / med / 1e9, bytes / med / memcpy_bw,
              bytes / med / fresh_bw,
              *std::min_element(t.begin(), t.end()) * 1e3,
              *std::max_element(t.begin(), t.end()) * 1e3, t.size());
}

int Main() {
  absl::StatusOr<std::unique_ptr<bench::BenchDaemon>> daemon =
      bench::BenchDaemon::Start();
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
  auto src = SharedTensorArena::Create("bench.offload.src",
                                       trainer_layout.buffer_bytes[0], 0);
  if (!src.ok()) return 1;
  for (int64_t i = 0; i < trainer_layout.buffer_bytes[0]; ++i) {
    (*src)->data()[i] = static_cast<uint8_t>(i * 131 + (i >> 12));
  }
  SourceOptions so;
  so.stream = "policy";
  auto source = SourceClient::Register(
      *c, so,
      SourceLayout{schema->spec, trainer_layout.pieces, {(*src)->Describe()}});
  if (!source.ok()) {
    LOG(ERROR) << source.status();
    return 1;
  }
  auto engine = VerifyingEngine::Create(*schema, 1, 0, {}, "bench.offload.e");
  auto mirror = VerifyingEngine::Create(*schema, 1, 0, {}, "bench.offload.m");
  if (!engine.ok() || !mirror.ok()) return 1;
  SharedTensorArena& arena = (*engine)->arena();
  DestinationCallbacks callbacks;
  callbacks.on_offload = [&](const std::vector<uint32_t>&, bool) {
    arena.Release();
    return absl::OkStatus();
  };
  callbacks.on_onload = [&](const std::vector<uint32_t>&)
      -> absl::StatusOr<std::vector<v1::MemoryRegion>> {
    absl::Status s = arena.Reallocate();
    if (!s.ok()) return s;
    return std::vector<v1::MemoryRegion>{arena.Describe()};
  };
  auto register_engine = [&](const std::string& id, VerifyingEngine& e,
                             DestinationCallbacks cb) {
    DestinationOptions o;
    o.instance_id = id;
    o.stream = "policy";
    return DestinationClient::Register(
        *c, o,
        DestinationLayout::FromEngineTable(e.table(), {e.arena().Describe()}),
        std::move(cb));
  };
  // "m" holds the same version: the oracle the engine's bytes are compared
  // with after each onload (its own arena is never offloaded).
  auto e = register_engine("e", **engine, callbacks);
  auto m = register_engine("m", **mirror, DestinationCallbacks{});
  if (!e.ok() || !m.ok()) return 1;
  absl::StatusOr<PublishOutcome> v1 = (*source)->PublishVersion(1);
  if (!v1.ok() || !v1->all_committed()) {
    LOG(ERROR) << "version 1 did not commit";
    return 1;
  }
  const int64_t bytes = arena.capacity();
  const double memcpy_bw = MemcpyBandwidth((*mirror)->arena().data(),
                                           arena.data(), bytes);
  const double fresh_bw = FreshMemcpyBandwidth((*mirror)->arena().data(), bytes);
  const uint8_t* want = (*mirror)->arena().data();

  std::vector<double> offloads, onloads, restores;
  for (int i = 0; i < FLAGS_rounds; ++i) {
    absl::Time start = absl::Now();
    absl::StatusOr<v1::InstanceStatus> off = Offload(*c, "e", true);
    offloads.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    if (!off.ok() || off->state() != v1::INSTANCE_STATE_OFFLOADED) {
      LOG(ERROR) << "offload failed: "
                 << (off.ok() ? off->DebugString() : off.status().ToString());
      return 1;
    }
    start = absl::Now();
    absl::StatusOr<v1::InstanceStatus> on = Onload(*c, "e");
    onloads.push_back(absl::ToDoubleSeconds(absl::Now() - start));
    if (!on.ok() || on->state() != v1::INSTANCE_STATE_COMMITTED) {
      LOG(ERROR) << "onload failed: "
                 << (on.ok() ? on->DebugString() : on.status().ToString());
      return 1;
    }
    // The restore itself: first byte written back .. COMMIT, as the daemon
    // reports the delivery (throughput over that span).
    v1::ListStreamsRequest req;
    req.set_stream("policy");
    v1::ListStreamsResponse resp;
    auto context = c->NewContext();
    if (!c->inspection().ListStreams(context.get(), req, &resp).ok() ||
        resp.streams_size() != 1 ||
        resp.streams(0).delivery().kind() != "onload") {
      LOG(ERROR) << "no onload delivery listed";
      return 1;
    }
    restores.push_back(
        bytes / resp.streams(0).delivery().throughput_bytes_per_second());
    if (std::memcmp(arena.data(), want, static_cast<size_t>(bytes)) != 0) {
      LOG(ERROR) << "round " << i << ": the onloaded bytes differ";
      return 1;
    }
  }
  std::printf("offload_bench: %ld cores online, ferryd in process\n",
              sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("model: llama-3.1-8b %s, %zu parameters, engine arena %.2f GiB "
              "(TP1, fused qkv/gate_up)\n",
              FLAGS_scale.c_str(), schema->spec.params.size(),
              static_cast<double>(bytes) / (1 << 30));
  std::printf("  single-thread memcpy, warm:  %6.2f GB/s\n", memcpy_bw / 1e9);
  std::printf("  memcpy into a fresh arena:   %6.2f GB/s\n", fresh_bw / 1e9);
  PrintTimes("offload", offloads, bytes, memcpy_bw, fresh_bw);
  PrintTimes("onload", onloads, bytes, memcpy_bw, fresh_bw);
  PrintTimes("restore", restores, bytes, memcpy_bw, fresh_bw);
  std::printf("  (onload: ONLOAD .. COMMIT, the rank's new arena allocated and "
              "mapped included;\n   restore: the host copy written back .. "
              "COMMIT, within the onload)\n");
  std::printf("  (target: onload >= 0.8x memcpy; every onload's bytes "
              "checked)\n");
  e->reset();
  m->reset();
  source->reset();
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage("same-node offload (host copy) and onload");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = 1;
  google::InitGoogleLogging(argv[0]);
  return ferry::Main();
}
