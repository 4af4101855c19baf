// demo_trainer: one trainer rank of the ferry demo.
//
// Builds what rank --rank of a Megatron-style trainer (--tp x --pp x --dp)
// holds of a scaled Llama model (core/models), puts it in a shared-memory
// arena, registers it with ferryd as a source of --stream, waits until the
// stream and --wait_instances engine instances are completely registered,
// then publishes versions --first_version .. --first_version + --versions - 1.
// Before each version it writes the version's deterministic bytes
// (weight_pattern.h) into its pieces, so every engine can verify what it
// received on its own. --stall_before_commit_version=N (fault tests) makes
// the rank begin version N and then hang, never committing it.
//
// Exit codes: 0 every version committed on every instance; 1 some instance
// aborted a version; 2 an error (flags, daemon, registration, protocol).
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/gpu_mirror.h"
#include "examples/demo/weight_pattern.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/explain.h"
#include "core/models/trainer_layout.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "common/flags_help.h"

DEFINE_string(daemon, "", "ferryd address: unix:PATH or host:port (default: "
              "$FERRY_SOCKET, $XDG_RUNTIME_DIR/ferry/ferryd.sock, "
              "/tmp/ferry-$UID/ferryd.sock)");
DEFINE_string(stream, "policy", "stream (model) this trainer publishes");
DEFINE_string(device, "host",
              "where the rank's tensors live: host (shared memory) or cuda:N "
              "(GPU N; registered as a CUDA IPC region)");
DEFINE_string(model, "llama-3.1-8b", "schema in shared/models");
DEFINE_string(scale, "demo", "model size: demo (~1.7 GB), small, tiny, full");
DEFINE_int32(tp, 1, "trainer tensor parallelism");
DEFINE_int32(pp, 1, "trainer pipeline parallelism");
DEFINE_int32(dp, 1, "trainer data parallelism (replicas)");
DEFINE_int32(rank, 0, "this rank, 0 <= rank < tp*pp*dp");
DEFINE_string(node, "", "node name to check against the daemon's (optional)");
DEFINE_int32(versions, 3, "versions to publish");
DEFINE_int64(first_version, 1, "first version number");
DEFINE_int32(wait_instances, 1,
             "complete engine instances to wait for before publishing");
DEFINE_int32(wait_timeout_s, 120, "how long to wait for them");
DEFINE_int32(interval_ms, 0, "pause between versions");
DEFINE_bool(replace_existing, false, "take over this rank's registration");
DEFINE_int64(stall_before_commit_version, 0,
             "fault injection (tests): after BeginVersion of this version, "
             "print 'STALLED before CommitVersion v<N>' and sleep until "
             "killed instead of committing (0: off)");

namespace ferry {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void OnSignal(int) { g_interrupted = 1; }

// Waits until all source ranks and `instances` complete instances of the
// stream are registered. DEADLINE_EXCEEDED says what is missing.
// One line for a person watching the demo: how many bytes version `v`
// moved into the instances, how fast, and how much of the model landed
// directly in live parameters (rather than through an engine's loader).
std::string VersionReport(const Connection& connection, const std::string& stream,
                          int64_t v) {
  v1::GetProgressRequest request;
  request.set_stream(stream);
  request.set_version(v);
  v1::GetProgressResponse progress;
  if (!connection.inspection()
           .GetProgress(connection.NewContext().get(), request, &progress)
           .ok()) {
    return "";
  }
  std::string line = absl::StrCat(
      HumanBytes(progress.bytes_moved()), " moved in ", progress.elapsed_ms(),
      " ms (begin to settled), ",
      absl::StrFormat("%.2f GB/s", progress.throughput_bytes_per_second() / 1e9));
  for (const v1::InstanceProgress& instance : progress.instances()) {
    v1::ExplainPlanRequest explain_request;
    explain_request.set_stream(stream);
    explain_request.set_instance_id(instance.status().instance_id());
    v1::ExplainPlanResponse explain;
    if (connection.inspection()
            .ExplainPlan(connection.NewContext().get(), explain_request, &explain)
            .ok()) {
      absl::StrAppend(&line, absl::StrFormat(
                                 "; %s direct coverage %.1f%%",
                                 instance.status().instance_id(),
                                 100 * explain.totals().direct_byte_coverage()));
    }
  }
  return line;
}

absl::Status WaitForParticipants(const Connection& connection,
                                 const std::string& stream, int world_size,
                                 int instances, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  std::string missing = "no answer yet";
  while (absl::Now() < deadline && !g_interrupted) {
    v1::ListStreamsRequest request;
    request.set_stream(stream);
    v1::ListStreamsResponse response;
    auto context = connection.NewContext(absl::Seconds(5));
    grpc::Status s =
        connection.inspection().ListStreams(context.get(), request, &response);
    if (s.ok() && response.streams_size() == 1) {
      const v1::StreamInfo& info = response.streams(0);
      int complete = 0;
      for (const v1::InstanceInfo& i : info.instances()) {
        if (i.registered_tp_ranks_size() == i.tp_size()) ++complete;
      }
      if (info.registered_ranks_size() == world_size && complete >= instances) {
        return absl::OkStatus();
      }
      missing = absl::StrCat(info.registered_ranks_size(), "/", world_size,
                             " source ranks, ", complete, "/", instances,
                             " complete instances");
    } else if (!s.ok()) {
      missing = FromGrpcStatus(s, "ListStreams").ToString();
    }
    absl::SleepFor(absl::Milliseconds(200));
  }
  if (g_interrupted) return absl::CancelledError("interrupted");
  return absl::DeadlineExceededError(absl::StrCat(
      "stream ", stream, " not ready after ", absl::FormatDuration(timeout),
      ": ", missing));
}

int Run() {
  const int world = FLAGS_tp * FLAGS_pp * FLAGS_dp;
  if (FLAGS_tp < 1 || FLAGS_pp < 1 || FLAGS_dp < 1 || FLAGS_rank < 0 ||
      FLAGS_rank >= world || FLAGS_versions < 0 || FLAGS_first_version < 1) {
    LOG(ERROR) << "bad flags: need tp, pp, dp >= 1, 0 <= rank < tp*pp*dp ("
               << world << "), versions >= 0, first_version >= 1";
    return 2;
  }
  absl::StatusOr<ModelSchema> schema = LoadDemoModel(FLAGS_model, FLAGS_scale);
  if (!schema.ok()) {
    LOG(ERROR) << schema.status();
    return 2;
  }
  TrainerParallelism par;
  par.tp = FLAGS_tp;
  par.pp = FLAGS_pp;
  par.dp = FLAGS_dp;
  absl::StatusOr<std::vector<RankLayout>> layouts =
      BuildTrainerLayout(schema->spec, schema->config, par);
  if (!layouts.ok()) {
    LOG(ERROR) << layouts.status();
    return 2;
  }
  const RankLayout& mine = (*layouts)[FLAGS_rank];
  const int64_t bytes = mine.buffer_bytes.empty() ? 0 : mine.buffer_bytes[0];
  LOG(INFO) << "model " << schema->name << ": " << schema->spec.params.size()
            << " tensors, " << HumanBytes(TotalBytes(schema->spec))
            << "; rank " << FLAGS_rank << "/" << world << " holds "
            << mine.pieces.size() << " pieces in " << HumanBytes(bytes);

  absl::StatusOr<std::unique_ptr<SharedTensorArena>> arena =
      SharedTensorArena::Create(
          absl::StrCat(FLAGS_stream, ".r", FLAGS_rank), std::max<int64_t>(bytes, 1),
          /*region_id=*/0);
  if (!arena.ok()) {
    LOG(ERROR) << arena.status();
    return 2;
  }
  // core/models places tensors itself (256-byte aligned, like the arena);
  // claim the whole layout as one slot so the arena's books agree.
  if (bytes > 0 && !(*arena)->Allocate(bytes).ok()) return 2;

  // --device=cuda:N: ferryd reads the GPU copy, uploaded before each
  // version from the arena the weights are computed in.
  std::unique_ptr<GpuMirror> gpu;
  if (FLAGS_device != "host") {
    absl::StatusOr<std::unique_ptr<GpuMirror>> mirror =
        GpuMirror::Create(FLAGS_device, bytes);
    if (!mirror.ok()) {
      LOG(ERROR) << mirror.status();
      return 2;
    }
    gpu = *std::move(mirror);
  }

  ConnectionOptions copts;
  copts.address = FLAGS_daemon;
  absl::StatusOr<Connection> connection =
      Connection::Connect(copts, absl::Seconds(10));
  if (!connection.ok()) {
    LOG(ERROR) << connection.status();
    return 2;
  }

  SourceOptions options;
  options.stream = FLAGS_stream;
  options.rank = FLAGS_rank;
  options.world_size = world;
  options.node = FLAGS_node;
  options.replace_existing = FLAGS_replace_existing;
  SourceLayout layout;
  layout.model = schema->spec;
  layout.pieces = mine.pieces;
  layout.regions = {gpu != nullptr ? gpu->Describe((*arena)->region_id())
                                   : (*arena)->Describe()};
  absl::StatusOr<std::unique_ptr<SourceClient>> source =
      SourceClient::Register(*connection, options, layout);
  if (!source.ok()) {
    LOG(ERROR) << source.status();
    return 2;
  }

  if (absl::Status s = WaitForParticipants(
          *connection, FLAGS_stream, world, FLAGS_wait_instances,
          absl::Seconds(FLAGS_wait_timeout_s));
      !s.ok()) {
    LOG(ERROR) << s;
    return 2;
  }

  int exit_code = 0;
  for (int i = 0; i < FLAGS_versions && !g_interrupted; ++i) {
    const int64_t v = FLAGS_first_version + i;
    const absl::Time fill_start = absl::Now();
    for (const Piece& piece : mine.pieces) {
      FillPiece(v, schema->spec.params[piece.param], piece, (*arena)->data());
    }
    if (gpu != nullptr) {
      if (absl::Status s = gpu->Upload((*arena)->data()); !s.ok()) {
        LOG(ERROR) << s;
        return 2;
      }
    }
    const absl::Time publish_start = absl::Now();
    if (v == FLAGS_stall_before_commit_version) {
      absl::StatusOr<std::vector<std::string>> begun = (*source)->BeginVersion(v);
      if (!begun.ok()) {
        LOG(ERROR) << begun.status();
        return 2;
      }
      std::printf("STALLED before CommitVersion v%ld\n", static_cast<long>(v));
      std::fflush(stdout);
      while (!g_interrupted) absl::SleepFor(absl::Milliseconds(100));
      break;
    }
    absl::StatusOr<PublishOutcome> outcome = (*source)->PublishVersion(v);
    if (!outcome.ok()) {
      LOG(ERROR) << outcome.status();
      return 2;
    }
    LOG(INFO) << outcome->Summary() << " (wrote weights in "
              << absl::FormatDuration(publish_start - fill_start)
              << ", published in "
              << absl::FormatDuration(absl::Now() - publish_start) << ")";
    if (FLAGS_rank == 0) {
      const std::string report = VersionReport(*connection, FLAGS_stream, v);
      if (!report.empty()) LOG(INFO) << "version " << v << ": " << report;
    }
    if (!outcome->all_committed()) exit_code = 1;
    if (FLAGS_interval_ms > 0) absl::SleepFor(absl::Milliseconds(FLAGS_interval_ms));
  }
  if (g_interrupted) {
    LOG(WARNING) << "interrupted; deregistering";
    return 2;
  }
  return exit_code;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "one trainer rank of the ferry demo: registers its shard of a scaled "
      "Llama model with ferryd and publishes versions.\n"
      "  demo_trainer --daemon=unix:/tmp/ferry.sock --tp=2 --rank=0 "
      "--versions=3\nExit: 0 all committed, 1 an instance aborted, 2 error.");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  std::signal(SIGINT, ferry::OnSignal);
  std::signal(SIGTERM, ferry::OnSignal);
  return ferry::Run();
}
