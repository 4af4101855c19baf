// A one-rank (TP 1) trainer of the tiny demo model in the test's own
// process: registers a shared-memory arena as a source of stream "policy"
// (or another stream) and publishes versions whose bytes are
// weight_pattern.h's, so that demo engines in other processes can verify
// every byte on their own.
#ifndef FERRY_TESTS_CLIENT_IN_PROCESS_TRAINER_H_
#define FERRY_TESTS_CLIENT_IN_PROCESS_TRAINER_H_

#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/weight_pattern.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/models/trainer_layout.h"

namespace ferry {
namespace testing {

class InProcessTrainer {
 public:
  // `arena_hint` names the trainer's /dev/shm object.
  InProcessTrainer(const Connection& connection, const std::string& arena_hint,
                   const std::string& stream = "policy") {
    auto schema = LoadDemoModel("llama-3.1-8b", "tiny");
    REQUIRE(schema.ok());
    schema_ = *std::move(schema);
    auto layouts = BuildTrainerLayout(schema_.spec, schema_.config,
                                      TrainerParallelism{});
    REQUIRE(layouts.ok());
    layout_ = (*layouts)[0];
    auto arena =
        SharedTensorArena::Create(arena_hint, layout_.buffer_bytes[0], 0);
    REQUIRE(arena.ok());
    arena_ = *std::move(arena);
    SourceOptions o;
    o.stream = stream;
    auto source = SourceClient::Register(
        connection, o,
        SourceLayout{schema_.spec, layout_.pieces, {arena_->Describe()}});
    INFO(source.status().ToString());
    REQUIRE(source.ok());
    source_ = *std::move(source);
  }

  // Writes version v's bytes, then BeginVersion + CommitVersion.
  absl::StatusOr<PublishOutcome> Publish(int64_t v) {
    for (const Piece& piece : layout_.pieces) {
      FillPiece(v, schema_.spec.params[piece.param], piece, arena_->data());
    }
    return source_->PublishVersion(v);
  }
  // Overwrites the trainer's memory without publishing (its memory has
  // moved on): a delivery that read it now would deliver garbage.
  void Scribble() { std::memset(arena_->data(), 0xab, layout_.buffer_bytes[0]); }
  SourceClient& client() { return *source_; }

 private:
  ModelSchema schema_;
  RankLayout layout_;
  std::unique_ptr<SharedTensorArena> arena_;
  std::unique_ptr<SourceClient> source_;
};

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_CLIENT_IN_PROCESS_TRAINER_H_
