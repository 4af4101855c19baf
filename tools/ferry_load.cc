// ferry_load: a checkpoint file as a source of weights (safetensors, a
// sharded safetensors index, or GGUF v3).
//
//   ferry_load --file=MODEL.gguf --engine=tp=N --explain [--json]
//   ferry_load --file=MODEL.safetensors --stream=policy
//              [--publish_version=V] [--daemon=unix:PATH] [--wait_s=S]
//
// --explain prints, per tensor, the file's name, the engine's (Hugging
// Face) name, the ggml type or dtype, how it splits over N TP ranks
// (outer, inner, replicated, or fallback with the reason) and each rank's
// absolute byte ranges of the file (checkpoint/tp_split.h). The file is
// read and checked completely first: a malformed one is an error naming
// the file, the tensor and the byte offset (exit 1).
//
// Without --explain it publishes the checkpoint as the next version of
// --stream into every instance that follows it (client/checkpoint_source.h:
// the files registered read-only as the stream's only source, no copy),
// prints the outcome and exits 0 when every instance committed, 1
// otherwise. The stream must have no trainer registered.
#include <limits.h>
#include <stdlib.h>

#include <cstdio>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/tp_split.h"
#include "client/checkpoint_source.h"
#include "client/connection.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "common/flags_help.h"

DEFINE_string(file, "", "the checkpoint: MODEL.gguf, MODEL.safetensors or "
                        "model.safetensors.index.json (required)");
DEFINE_string(engine, "tp=1", "the engine's parallelism: tp=N");
DEFINE_bool(explain, false, "print how every tensor splits over the ranks");
DEFINE_bool(json, false, "--explain as JSON");
DEFINE_string(daemon, "", "publish: ferryd's unix socket (unix:PATH; default "
                          "$FERRY_SOCKET, else the usual per-user path)");
DEFINE_string(stream, "", "publish: the stream whose instances receive it");
DEFINE_int64(publish_version, 0, "publish: the version number (default: the stream's "
                         "latest committed + 1)");
DEFINE_int32(wait_s, 0, "publish: wait this long for the stream's instances "
                        "to be complete before beginning");
DEFINE_int32(kv_heads, 0,
             "key/value heads (default: the GGUF metadata's "
             "<arch>.attention.head_count_kv, else k/v split like q)");

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "a checkpoint file as a source of weights\n"
      "  ferry_load --file=MODEL.gguf --engine=tp=N --explain [--json]\n"
      "  ferry_load --file=MODEL.safetensors --stream=S [--publish_version=V] "
      "[--daemon=unix:PATH]");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = 1;  // warnings and errors: the outcome is stdout
  google::InitGoogleLogging(argv[0]);
  if (FLAGS_file.empty()) {
    std::cerr << "ferry_load: --file is required (see --help)\n";
    return 2;
  }
  int tp = 0;
  if (!absl::StartsWith(FLAGS_engine, "tp=") ||
      !absl::SimpleAtoi(FLAGS_engine.substr(3), &tp) || tp < 1) {
    std::cerr << "ferry_load: --engine takes tp=N with N >= 1; got '"
              << FLAGS_engine << "'\n";
    return 2;
  }
  if (!FLAGS_explain && FLAGS_stream.empty()) {
    std::cerr << "ferry_load: give --explain, or --stream to publish (see "
                 "--help)\n";
    return 2;
  }
  char resolved[PATH_MAX];
  const std::string path =
      ::realpath(FLAGS_file.c_str(), resolved) != nullptr ? resolved : FLAGS_file;
  absl::StatusOr<ferry::Checkpoint> c = ferry::OpenCheckpoint(path);
  if (!c.ok()) {
    std::cerr << "ferry_load: " << c.status().message() << "\n";
    return 1;
  }
  if (!FLAGS_explain) {
    ferry::ConnectionOptions co;
    co.address = FLAGS_daemon;
    absl::StatusOr<ferry::Connection> conn =
        ferry::Connection::Connect(co, absl::Seconds(10));
    if (!conn.ok()) {
      std::cerr << "ferry_load: " << conn.status().message() << "\n";
      return 1;
    }
    ferry::CheckpointPublishOptions po;
    po.stream = FLAGS_stream;
    po.version = FLAGS_publish_version;
    po.wait_for_instances = absl::Seconds(FLAGS_wait_s);
    absl::StatusOr<ferry::PublishOutcome> out =
        ferry::PublishCheckpoint(*conn, *c, po);
    if (!out.ok()) {
      std::cerr << "ferry_load: " << out.status().message() << "\n";
      return 1;
    }
    std::cout << "ferry_load: " << path << " published to stream "
              << FLAGS_stream << ": " << out->Summary() << "\n";
    return out->all_committed() ? 0 : 1;
  }
  ferry::SplitOptions options;
  options.tp = tp;
  options.kv_heads = FLAGS_kv_heads;
  absl::StatusOr<std::vector<ferry::TensorSplit>> splits =
      ferry::PlanTpSplits(*c, options);
  if (!splits.ok()) {
    std::cerr << "ferry_load: " << splits.status().message() << "\n";
    return 1;
  }
  std::cout << (FLAGS_json ? ferry::TpSplitsJson(path, tp, *splits)
                           : ferry::FormatTpSplits(path, tp, *splits));
  return 0;
}
