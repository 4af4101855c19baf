// demo_engine: one TP rank of an inference engine instance in the ferry
// demo.
//
// Allocates the live parameters vLLM would hold at --tp for a scaled Llama
// model (fused qkv_proj and gate_up_proj, vocab-parallel embeddings; from
// core/models BuildEngineTables) in a shared-memory arena, registers the
// table with ferryd, and follows the version protocol:
//   APPLY   checks every fallback tensor against the version's expected
//           bytes, then "loads" it: copies the rank's share into the live
//           parameter, as vLLM's weight loader would;
//   COMMIT  checks every byte of every live parameter against the expected
//           bytes of the version and logs OK or the first mismatch.
// --device=cuda:N keeps the live parameters on GPU N (gpu_mirror.h): the
// checks run on a host copy downloaded from it.
// --fallback=SUBSTR,... forces the engine parameters whose names contain one
// of the substrings through the fallback path (flagged as transformed), to
// exercise staging and APPLY.
//
// Exits after committing --exit_after_version (0: runs until SIGINT/TERM).
// Exit codes: 0 every checked version matched; 1 a mismatch or an aborted
// version; 2 an error (flags, daemon, registration); 3 timed out.
#include <atomic>
#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/gpu_mirror.h"
#include "examples/demo/verifying_engine.h"
#include "client/destination_client.h"
#include "core/explain.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "common/flags_help.h"

DEFINE_string(daemon, "", "ferryd address: unix:PATH or host:port (default: "
              "$FERRY_SOCKET, $XDG_RUNTIME_DIR/ferry/ferryd.sock, "
              "/tmp/ferry-$UID/ferryd.sock)");
DEFINE_string(stream, "policy", "stream the instance follows");
DEFINE_string(device, "host",
              "where the live parameters live: host (shared memory) or "
              "cuda:N (GPU N; registered as a CUDA IPC region and copied to "
              "the host to be checked)");
DEFINE_string(instance, "vllm-0", "instance id (all TP ranks share it)");
DEFINE_string(model, "llama-3.1-8b", "schema in shared/models");
DEFINE_string(scale, "demo", "model size: demo (~1.7 GB), small, tiny, full");
DEFINE_int32(tp, 1, "the instance's tensor parallelism");
DEFINE_int32(tp_rank, 0, "this rank, 0 <= tp_rank < tp");
DEFINE_string(node, "", "node name to check against the daemon's (optional)");
DEFINE_string(fallback, "",
              "comma-separated substrings of engine parameter names to force "
              "through fallback (e.g. lm_head,layers.0.mlp)");
DEFINE_int64(exit_after_version, 0,
             "exit once this version committed (0: run until a signal)");
DEFINE_int32(timeout_s, 600, "give up (exit 3) after this long");
DEFINE_bool(replace_existing, false, "take over this rank's registration");
DEFINE_string(stall_in, "",
              "fault injection for tests: PAUSE or APPLY; with "
              "--stall_version, the callback of that event never returns "
              "(until SIGKILL), after printing 'STALLED <event> v<N>'");
DEFINE_int64(stall_version, 0, "version whose --stall_in event stalls");

namespace ferry {
namespace {

std::atomic<bool> g_interrupted{false};
void OnSignal(int) { g_interrupted = true; }

// Waits until `engine` committed `version` (0: until a signal) or the
// deadline; returns the exit code.
int WaitUntil(const VerifyingEngine& engine, const DestinationClient& client,
              int64_t version, absl::Time deadline) {
  int code = 0;
  while (!g_interrupted) {
    if (version > 0 && engine.committed_version() >= version) break;
    if (!client.status().ok()) {
      LOG(ERROR) << client.status();
      code = 2;
      break;
    }
    if (absl::Now() > deadline) {
      LOG(ERROR) << "timed out waiting for version " << version << " (holds "
                 << engine.committed_version() << ")";
      code = 3;
      break;
    }
    absl::SleepFor(absl::Milliseconds(100));
  }
  LOG(INFO) << "holds version " << engine.committed_version() << "; "
            << engine.mismatches() << " mismatches, " << engine.aborts()
            << " aborted versions, " << engine.fallback_tensors_loaded()
            << " fallback tensors loaded";
  if (code != 0) return code;
  return (engine.mismatches() > 0 || engine.aborts() > 0) ? 1 : 0;
}

int Run() {
  if (FLAGS_tp < 1 || FLAGS_tp_rank < 0 || FLAGS_tp_rank >= FLAGS_tp) {
    LOG(ERROR) << "bad flags: need tp >= 1 and 0 <= tp_rank < tp";
    return 2;
  }
  absl::StatusOr<ModelSchema> schema = LoadDemoModel(FLAGS_model, FLAGS_scale);
  if (!schema.ok()) {
    LOG(ERROR) << schema.status();
    return 2;
  }
  const std::vector<std::string> forced =
      absl::StrSplit(FLAGS_fallback, ',', absl::SkipEmpty());
  absl::StatusOr<std::unique_ptr<VerifyingEngine>> engine =
      VerifyingEngine::Create(*schema, FLAGS_tp, FLAGS_tp_rank, forced,
                              absl::StrCat(FLAGS_instance, ".tp", FLAGS_tp_rank));
  if (!engine.ok()) {
    LOG(ERROR) << engine.status();
    return 2;
  }
  LOG(INFO) << "model " << schema->name << ": " << schema->spec.params.size()
            << " tensors, " << HumanBytes(TotalBytes(schema->spec))
            << "; instance " << FLAGS_instance << " tp rank " << FLAGS_tp_rank
            << "/" << FLAGS_tp << " holds " << (*engine)->table().params.size()
            << " live parameters in " << HumanBytes((*engine)->arena().capacity())
            << " (" << (*engine)->forced_fallback_params()
            << " forced to fallback)";

  // --device=cuda:N: the live parameters are on the GPU; the arena is the
  // host copy the checks read (downloaded first) and the loader writes
  // (uploaded after).
  std::unique_ptr<GpuMirror> gpu;
  if (FLAGS_device != "host") {
    absl::StatusOr<std::unique_ptr<GpuMirror>> mirror =
        GpuMirror::Create(FLAGS_device, (*engine)->arena().capacity());
    if (!mirror.ok()) {
      LOG(ERROR) << mirror.status();
      return 2;
    }
    gpu = *std::move(mirror);
    if (absl::Status s = gpu->Upload((*engine)->arena().data()); !s.ok()) {
      LOG(ERROR) << s;
      return 2;
    }
  }

  ConnectionOptions copts;
  copts.address = FLAGS_daemon;
  absl::StatusOr<Connection> connection =
      Connection::Connect(copts, absl::Seconds(10));
  if (!connection.ok()) {
    LOG(ERROR) << connection.status();
    return 2;
  }
  DestinationOptions options;
  options.instance_id = FLAGS_instance;
  options.stream = FLAGS_stream;
  options.tp_rank = FLAGS_tp_rank;
  options.tp_size = FLAGS_tp;
  options.node = FLAGS_node;
  options.replace_existing = FLAGS_replace_existing;
  DestinationCallbacks callbacks = (*engine)->Callbacks();
  if (!FLAGS_stall_in.empty()) {
    auto stall = [](const char* event, int64_t v) {
      if (v != FLAGS_stall_version) return;
      std::printf("STALLED %s v%ld\n", event, static_cast<long>(v));
      std::fflush(stdout);
      while (true) absl::SleepFor(absl::Hours(1));  // until killed
    };
    if (FLAGS_stall_in == "PAUSE") {
      auto inner = callbacks.on_pause;
      callbacks.on_pause = [inner, stall](int64_t v) {
        stall("PAUSE", v);
        return inner(v);
      };
    } else if (FLAGS_stall_in == "APPLY") {
      auto inner = callbacks.on_apply;
      callbacks.on_apply = [inner, stall](
                               int64_t v,
                               const std::vector<FallbackTensorView>& t) {
        stall("APPLY", v);
        return inner(v, t);
      };
    } else {
      LOG(ERROR) << "--stall_in must be PAUSE or APPLY";
      return 2;
    }
  }
  v1::MemoryRegion region = (*engine)->arena().Describe();
  if (gpu != nullptr) {
    uint8_t* host = (*engine)->arena().data();
    GpuMirror* mirror = gpu.get();
    auto apply = callbacks.on_apply;
    callbacks.on_apply = [apply, mirror, host](
                             int64_t v, const std::vector<FallbackTensorView>& t) {
      if (t.empty()) return apply(v, t);
      if (absl::Status s = mirror->Download(host); !s.ok()) return s;
      if (absl::Status s = apply(v, t); !s.ok()) return s;
      return mirror->Upload(host);
    };
    auto commit = callbacks.on_commit;
    callbacks.on_commit = [commit, mirror, host](int64_t v) {
      absl::Status s = mirror->Download(host);
      if (!s.ok()) LOG(ERROR) << "COMMIT v" << v << ": " << s;
      commit(v);
    };
    region = gpu->Describe(region.region_id());
  }
  absl::StatusOr<std::unique_ptr<DestinationClient>> client =
      DestinationClient::Register(
          *connection, options,
          DestinationLayout::FromEngineTable((*engine)->table(), {region}),
          std::move(callbacks));
  if (!client.ok()) {
    LOG(ERROR) << client.status();
    return 2;
  }
  const int code =
      WaitUntil(**engine, **client, FLAGS_exit_after_version,
                absl::Now() + absl::Seconds(FLAGS_timeout_s));
  client->reset();  // deregister before the arena goes
  return code;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "one TP rank of an inference engine instance in the ferry demo: "
      "registers vLLM-style live parameters with ferryd and verifies every "
      "byte of every version it receives.\n"
      "  demo_engine --daemon=unix:/tmp/ferry.sock --instance=vllm-0 --tp=2 "
      "--tp_rank=0 --exit_after_version=3\n"
      "Exit: 0 all matched, 1 mismatch or abort, 2 error, 3 timeout.");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  std::signal(SIGINT, ferry::OnSignal);
  std::signal(SIGTERM, ferry::OnSignal);
  return ferry::Run();
}
