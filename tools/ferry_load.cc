// ferry_load: a checkpoint file as a source of weights (safetensors, a
// sharded safetensors index, or GGUF v3).
//
//   ferry_load --file=MODEL.gguf --engine=tp=N --explain [--json]
//
// --explain prints, per tensor, the file's name, the engine's (Hugging
// Face) name, the ggml type or dtype, how it splits over N TP ranks
// (outer, inner, replicated, or fallback with the reason) and each rank's
// absolute byte ranges of the file (checkpoint/tp_split.h). The file is
// read and checked completely first: a malformed one is an error naming
// the file, the tensor and the byte offset (exit 1).
//
// Publishing a checkpoint into running instances as a version is not
// built yet; without --explain the tool says so (exit 2).
#include <cstdio>
#include <iostream>
#include <string>

#include "absl/strings/numbers.h"
#include "absl/strings/match.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/tp_split.h"
#include "gflags/gflags.h"

DEFINE_string(file, "", "the checkpoint: MODEL.gguf, MODEL.safetensors or "
                        "model.safetensors.index.json (required)");
DEFINE_string(engine, "tp=1", "the engine's parallelism: tp=N");
DEFINE_bool(explain, false, "print how every tensor splits over the ranks");
DEFINE_bool(json, false, "--explain as JSON");
DEFINE_int32(kv_heads, 0,
             "key/value heads (default: the GGUF metadata's "
             "<arch>.attention.head_count_kv, else k/v split like q)");

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "a checkpoint file as a source of weights\n"
      "  ferry_load --file=MODEL.gguf --engine=tp=N --explain [--json]");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
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
  if (!FLAGS_explain) {
    std::cerr << "ferry_load: publishing a checkpoint into running instances "
                 "is not built yet; --explain shows how it would split\n";
    return 2;
  }
  absl::StatusOr<ferry::Checkpoint> c = ferry::OpenCheckpoint(FLAGS_file);
  if (!c.ok()) {
    std::cerr << "ferry_load: " << c.status().message() << "\n";
    return 1;
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
  std::cout << (FLAGS_json ? ferry::TpSplitsJson(FLAGS_file, tp, *splits)
                           : ferry::FormatTpSplits(FLAGS_file, tp, *splits));
  return 0;
}
