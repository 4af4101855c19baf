// End to end, no fakes: the real ferryd binary on a temporary unix socket,
// two trainer ranks (SourceClient, TP 2) and two engine instances
// (DestinationClient + VerifyingEngine): "direct" at TP 2 with every
// parameter resolved direct or fused, and "fallback" at TP 1 with lm_head
// and layer 0's MLP forced through staging. Three versions; after each,
// every live byte of every rank must equal the version's expected bytes.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/verifying_engine.h"
#include "examples/demo/weight_pattern.h"
#include "client/destination_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/models/trainer_layout.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "tests/client/process_harness.h"

namespace ferry {
namespace {

// ferryd as a child process, stopped with SIGTERM (then SIGKILL) on exit.
class Daemon {
 public:
  explicit Daemon(const std::string& socket)
      : socket_(socket),
        process_(testing::StartFerryd(
            {"--socket=" + socket, "--listen=", "--node=e2e",
             "--lease_ms=5000", "--ack_timeout_ms=30000",
             "--version_timeout_ms=60000", "--logtostderr"},
            /*log=*/"")) {}
  ~Daemon() { process_->Stop(SIGTERM, absl::Seconds(10)); }
  std::string address() const { return "unix:" + socket_; }

 private:
  std::string socket_;
  std::unique_ptr<testing::Process> process_;
};

TEST_CASE("three versions from a TP-2 trainer to a direct and a fallback instance") {
  // Under /tmp, not TEST_TMPDIR: a unix socket path has at most 107
  // characters, and Bazel's sandbox paths are longer.
  char dir_template[] = "/tmp/ferry-e2e-XXXXXX";
  REQUIRE(mkdtemp(dir_template) != nullptr);
  const std::string dir = dir_template;
  struct RemoveDir {
    std::string path;
    ~RemoveDir() {
      unlink((path + "/ferryd.sock").c_str());  // if ferryd left it
      rmdir(path.c_str());
    }
  } remove_dir{dir};  // declared before the daemon: runs after it stopped
  Daemon daemon(dir + "/ferryd.sock");

  ConnectionOptions copts;
  copts.address = daemon.address();
  auto connection = Connection::Open(copts);
  REQUIRE(connection.ok());
  REQUIRE(connection->WaitForReady(absl::Seconds(20)).ok());

  auto schema = LoadDemoModel("llama-3.1-8b", "small");
  REQUIRE(schema.ok());

  // Sources: Megatron TP 2.
  TrainerParallelism par;
  par.tp = 2;
  auto layouts = BuildTrainerLayout(schema->spec, schema->config, par);
  REQUIRE(layouts.ok());
  std::vector<std::unique_ptr<SharedTensorArena>> source_arenas;
  std::vector<std::unique_ptr<SourceClient>> sources;
  for (int rank = 0; rank < 2; ++rank) {
    const int64_t bytes = (*layouts)[rank].buffer_bytes[0];
    auto arena = SharedTensorArena::Create(absl::StrCat("e2e.r", rank), bytes, 0);
    REQUIRE(arena.ok());
    SourceOptions o;
    o.stream = "policy";
    o.rank = rank;
    o.world_size = 2;
    SourceLayout layout{schema->spec, (*layouts)[rank].pieces,
                        {(*arena)->Describe()}};
    auto source = SourceClient::Register(*connection, o, layout);
    INFO(source.status().ToString());
    REQUIRE(source.ok());
    source_arenas.push_back(*std::move(arena));
    sources.push_back(*std::move(source));
  }

  // Destinations.
  struct Rank {
    std::unique_ptr<VerifyingEngine> engine;
    std::unique_ptr<DestinationClient> client;
  };
  std::vector<Rank> ranks;
  auto add_instance = [&](const std::string& id, int tp,
                          const std::vector<std::string>& forced) {
    for (int r = 0; r < tp; ++r) {
      auto engine = VerifyingEngine::Create(*schema, tp, r, forced,
                                            absl::StrCat(id, ".tp", r));
      REQUIRE(engine.ok());
      DestinationOptions o;
      o.instance_id = id;
      o.stream = "policy";
      o.tp_rank = r;
      o.tp_size = tp;
      auto client = DestinationClient::Register(
          *connection, o,
          DestinationLayout::FromEngineTable((*engine)->table(),
                                             {(*engine)->arena().Describe()}),
          (*engine)->Callbacks());
      INFO(client.status().ToString());
      REQUIRE(client.ok());
      ranks.push_back(Rank{*std::move(engine), *std::move(client)});
    }
  };
  add_instance("direct", 2, {});
  add_instance("fallback", 1, {"lm_head", "layers.0.mlp"});
  REQUIRE(ranks.back().engine->forced_fallback_params() >= 3);

  for (int64_t v = 1; v <= 3; ++v) {
    for (int rank = 0; rank < 2; ++rank) {
      for (const Piece& piece : (*layouts)[rank].pieces) {
        FillPiece(v, schema->spec.params[piece.param], piece,
                  source_arenas[rank]->data());
      }
    }
    // SPMD: both ranks publish at once; each CommitVersion returns when
    // every instance settled.
    std::vector<absl::StatusOr<PublishOutcome>> outcomes(
        2, absl::UnknownError("not run"));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back(
          [&, rank] { outcomes[rank] = sources[rank]->PublishVersion(v); });
    }
    for (std::thread& t : threads) t.join();
    for (int rank = 0; rank < 2; ++rank) {
      INFO("version " << v << " rank " << rank << ": "
                      << outcomes[rank].status().ToString());
      REQUIRE(outcomes[rank].ok());
      INFO(outcomes[rank]->Summary());
      CHECK(outcomes[rank]->instances.size() == 2);
      CHECK(outcomes[rank]->all_committed());
    }
    for (Rank& r : ranks) {
      INFO(r.client->who() << " at version " << v);
      REQUIRE(r.client->AwaitCommitted(v, absl::Seconds(30)).ok());
      CHECK(r.engine->VerifyLive(v).ok());
      CHECK(r.engine->mismatches() == 0);
    }
    auto status = ranks[0].client->WaitForVersion(v, absl::Seconds(10));
    REQUIRE(status.ok());
    CHECK(status->state() == v1::INSTANCE_STATE_COMMITTED);
    CHECK(status->committed_version() == v);
  }
  CHECK(ranks.back().engine->fallback_tensors_loaded() >= 3 * 3);

  // Inspection sees what we registered.
  v1::ListStreamsResponse streams;
  auto context = connection->NewContext();
  REQUIRE(connection->inspection()
              .ListStreams(context.get(), v1::ListStreamsRequest(), &streams)
              .ok());
  REQUIRE(streams.streams_size() == 1);
  CHECK(streams.streams(0).latest_committed_version() == 3);
  CHECK(streams.streams(0).instances_size() == 2);

  // Destinations deregister before the sources; the arenas (owned by the
  // engines and source_arenas) outlive their clients.
  ranks.clear();
  sources.clear();
}

}  // namespace
}  // namespace ferry
