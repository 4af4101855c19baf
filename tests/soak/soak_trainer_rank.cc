// soak_trainer_rank: one trainer rank of the chaos soak, in a process of its
// own so that the soak can kill -9 it at any point of a version.
//
// Registers its shard of the demo model (Megatron-style TP, core/models) in
// a shared-memory arena as a source of stream "policy", prints
// "ready <participant id>" on stdout, then follows commands on stdin, one a
// line:
//   <v>   writes version v's bytes (weight_pattern.h) into its pieces,
//         PublishVersion(v), and answers one line on stdout:
//           "v <v> ok <committed> <aborted>"   the version settled
//           "v <v> error <code> <message>"     Begin/Commit failed
// EOF on stdin: deregisters, unlinks the arena, exits 0. Logs (glog) go to
// stderr, so stdout carries nothing but the answers.
//
// Unlike demo_trainer it never decides on its own when to publish: the soak
// paces every version, so it can choose when (and whether) to kill it.
#include <algorithm>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/weight_pattern.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/models/trainer_layout.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "proto/ferry/v1/types.pb.h"

DEFINE_string(daemon, "", "ferryd address (unix:PATH)");
DEFINE_string(model, "llama-3.1-8b", "schema in shared/models");
DEFINE_string(scale, "small", "demo model scale (examples/demo/demo_model.h)");
DEFINE_int32(tp, 2, "trainer tensor parallelism");
DEFINE_int32(rank, 1, "this rank");
DEFINE_string(arena_hint, "soak.trainer", "name hint of the /dev/shm arena");
DEFINE_bool(replace_existing, false, "take over this rank's registration");

namespace ferry {
namespace {

void Answer(const std::string& line) {
  std::fputs((line + "\n").c_str(), stdout);
  std::fflush(stdout);
}

int Run() {
  absl::StatusOr<ModelSchema> schema = LoadDemoModel(FLAGS_model, FLAGS_scale);
  if (!schema.ok()) {
    LOG(ERROR) << schema.status();
    return 2;
  }
  TrainerParallelism par;
  par.tp = FLAGS_tp;
  absl::StatusOr<std::vector<RankLayout>> layouts =
      BuildTrainerLayout(schema->spec, schema->config, par);
  if (!layouts.ok() || FLAGS_rank < 0 ||
      FLAGS_rank >= static_cast<int>(layouts->size())) {
    LOG(ERROR) << "no layout for rank " << FLAGS_rank << ": "
               << layouts.status();
    return 2;
  }
  const RankLayout& mine = (*layouts)[FLAGS_rank];
  const int64_t bytes = mine.buffer_bytes.empty() ? 0 : mine.buffer_bytes[0];
  absl::StatusOr<std::unique_ptr<SharedTensorArena>> arena =
      SharedTensorArena::Create(FLAGS_arena_hint, std::max<int64_t>(bytes, 1),
                                /*region_id=*/0);
  if (!arena.ok()) {
    LOG(ERROR) << arena.status();
    return 2;
  }
  // core/models placed the pieces itself: claim the whole layout.
  if (bytes > 0 && !(*arena)->Allocate(bytes).ok()) return 2;
  ConnectionOptions copts;
  copts.address = FLAGS_daemon;
  copts.rpc_timeout = absl::Seconds(15);
  absl::StatusOr<Connection> connection =
      Connection::Connect(copts, absl::Seconds(10));
  if (!connection.ok()) {
    LOG(ERROR) << connection.status();
    return 2;
  }
  SourceOptions options;
  options.stream = "policy";
  options.rank = FLAGS_rank;
  options.world_size = FLAGS_tp;
  options.replace_existing = FLAGS_replace_existing;
  options.commit_timeout = absl::Seconds(60);
  absl::StatusOr<std::unique_ptr<SourceClient>> source = SourceClient::Register(
      *connection, options,
      SourceLayout{schema->spec, mine.pieces, {(*arena)->Describe()}});
  if (!source.ok()) {
    LOG(ERROR) << source.status();
    return 2;
  }
  Answer(absl::StrCat("ready ", (*source)->handle().participant_id()));

  std::string line;
  while (std::getline(std::cin, line)) {
    int64_t v = 0;
    if (!absl::SimpleAtoi(line, &v) || v <= 0) {
      Answer(absl::StrCat("v 0 error INVALID_ARGUMENT bad command '", line, "'"));
      continue;
    }
    for (const Piece& piece : mine.pieces) {
      FillPiece(v, schema->spec.params[piece.param], piece, (*arena)->data());
    }
    absl::StatusOr<PublishOutcome> outcome = (*source)->PublishVersion(v);
    if (!outcome.ok()) {
      Answer(absl::StrCat("v ", v, " error ",
                          absl::StatusCodeToString(outcome.status().code()), " ",
                          outcome.status().message()));
      continue;
    }
    int committed = 0;
    for (const v1::InstanceStatus& s : outcome->instances) {
      committed += s.state() == v1::INSTANCE_STATE_COMMITTED;
    }
    LOG(INFO) << outcome->Summary();
    Answer(absl::StrCat("v ", v, " ok ", committed, " ",
                        outcome->instances.size() - committed));
  }
  source->reset();  // deregister before the arena goes
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "a trainer rank of the chaos soak, driven over stdin (see the file "
      "comment)");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging(argv[0]);
  return ferry::Run();
}
