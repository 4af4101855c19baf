// A checkpoint file published as a version into running instances
// (client/checkpoint_source.h): the file registered with an in-process
// ferryd as read-only source memory (MemoryRegion file_path), a TP4
// instance with fused qkv (lm_head through its loader) and a TP2 one; every
// byte checked against the test model's values of the version the file
// holds (ValueAt), written by this test from the formats' specifications.
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "checkpoint/checkpoint.h"
#include "client/checkpoint_source.h"
#include "tests/checkpoint/checkpoint_writers.h"
#include "tests/daemon/daemon_test_support.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

Bytes Floats(int param, int64_t n, int64_t version) {
  Bytes b(n * 4);
  for (int64_t i = 0; i < n; ++i) {
    const float v = ValueAt(param, i, version);
    std::memcpy(b.data() + i * 4, &v, 4);
  }
  return b;
}

int64_t Elems(const TestParam& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  return n;
}

std::string SafetensorsOf(int64_t version) {
  std::vector<SafeTensor> tensors;
  for (size_t p = 0; p < TestModel().size(); ++p) {
    const TestParam& t = TestModel()[p];
    tensors.push_back({t.name, "F32", t.shape, Floats(p, Elems(t), version)});
  }
  const std::string path = TempDir() + "/model.safetensors";
  WriteFile(path, BuildSafetensors(tensors));
  return path;
}

// The same model under its GGUF names (ne reversed), F32; `skip` leaves
// one tensor out.
std::string GgufOf(int64_t version, const std::string& skip = "") {
  const char* names[] = {"blk.0.attn_q.weight", "blk.0.attn_k.weight",
                         "blk.0.attn_v.weight", "blk.0.ffn_down.weight",
                         "output_norm.weight", "output.weight"};
  GgufWriter w;
  w.String("general.architecture", "llama");
  for (size_t p = 0; p < TestModel().size(); ++p) {
    if (names[p] == skip) continue;
    const TestParam& t = TestModel()[p];
    std::vector<uint64_t> ne(t.shape.rbegin(), t.shape.rend());
    w.Tensor(names[p], 0, ne, Floats(p, Elems(t), version));
  }
  const std::string path = TempDir() + "/model.gguf";
  WriteFile(path, w.Build());
  return path;
}

struct Fleet {
  Fleet() {
    for (const auto& [id, tp] : {std::pair<const char*, int>{"b", 4}, {"a", 2}}) {
      for (int r = 0; r < tp; ++r) {
        engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
        engines.back()->tp_size = tp;
        engines.back()->lm_head_direct = std::string(id) == "a";
        RegisterDestination(d, *engines.back());
        engines.back()->Run(d.versions.get());
      }
    }
    ConnectionOptions o;
    o.address = "unix:" + d.options.socket_path;
    auto c = Connection::Open(o);
    REQUIRE(c.ok());
    connection = std::make_unique<Connection>(*std::move(c));
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }
  void ExpectHolds(int64_t v) {
    for (auto& e : engines) {
      INFO(e->instance << " tp rank " << e->tp_rank);
      CHECK(Eventually([&] {
        std::lock_guard<std::mutex> lock(e->mu);
        return e->committed == v;
      }, absl::Seconds(5)));
      CHECK(e->Check(v) == "");
    }
  }
  absl::StatusOr<PublishOutcome> Publish(const std::string& path, int64_t v) {
    absl::StatusOr<Checkpoint> c = OpenCheckpoint(path);
    if (!c.ok()) return c.status();
    CheckpointPublishOptions o;
    o.stream = "policy";
    o.version = v;
    return PublishCheckpoint(*connection, *c, o);
  }

  TestDaemon d;
  std::vector<std::unique_ptr<EngineRank>> engines;
  std::unique_ptr<Connection> connection;
};

TEST_CASE("A safetensors and then a GGUF checkpoint published into a TP4 "
          "and a TP2 instance: every byte the file's") {
  Fleet f;
  absl::StatusOr<PublishOutcome> out = f.Publish(SafetensorsOf(7), 7);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  INFO(out->Summary());
  CHECK(out->instances.size() == 2);
  CHECK(out->all_committed());
  f.ExpectHolds(7);

  out = f.Publish(GgufOf(8), 8);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  CHECK(out->all_committed());
  f.ExpectHolds(8);
}

TEST_CASE("A checkpoint that lacks a tensor the engines need: the version "
          "aborts clean, naming it, and every instance keeps its version") {
  Fleet f;
  REQUIRE(f.Publish(SafetensorsOf(7), 7).ok());
  f.ExpectHolds(7);
  absl::StatusOr<PublishOutcome> out = f.Publish(GgufOf(8, "output.weight"), 8);
  INFO(out.status().ToString());
  REQUIRE(out.ok());
  for (const v1::InstanceStatus& s : out->instances) {
    INFO(s.DebugString());
    CHECK(s.state() == v1::INSTANCE_STATE_ABORTED);
    CHECK_FALSE(s.dirty());
    CHECK(s.abort_reason().find("lm_head.weight") != std::string::npos);
  }
  for (auto& e : f.engines) CHECK(e->Check(7) == "");
}

TEST_CASE("A file region is for sources only, and must be the caller's "
          "(absolute path, read-only)") {
  TestDaemon d;
  EngineRank e("x", 0, "policy");
  v1::RegisterDestinationRequest req = e.Registration();
  v1::MemoryRegion* r = req.mutable_destination()->mutable_regions(0);
  const std::string path = SafetensorsOf(1);
  r->mutable_shared_memory()->set_file_path(path);
  grpc::ClientContext ctx;
  v1::RegisterDestinationResponse resp;
  grpc::Status s = d.registry->RegisterDestination(&ctx, req, &resp);
  INFO(s.error_message());
  CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(s.error_message().find("a file_path region is read-only") !=
        std::string::npos);
}

TEST_CASE("Garbage in a source's file region is refused, named, and never "
          "blocks the daemon") {
  TestDaemon d;
  TrainerRank t(0, "policy");
  const std::string dir = TempDir();
  const std::string fifo = dir + "/pipe";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  struct Case {
    std::string path;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"model.safetensors", "must be an absolute path"},
      {fifo, "is not a regular file"},  // open(2) must not wait for a writer
      {dir, "is not a regular file"},
      {dir + "/missing.safetensors", "missing.safetensors"},
      {"/" + std::string(5000, 'a'), "is 5001 bytes"},
  };
  for (const Case& c : cases) {
    INFO(c.path.substr(0, 80));
    v1::RegisterSourceRequest req = t.Registration();
    req.mutable_source()->mutable_regions(0)->mutable_shared_memory()->set_file_path(
        c.path);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::RegisterSourceResponse resp;
    grpc::Status s = d.registry->RegisterSource(&ctx, req, &resp);
    INFO(s.error_message());
    CHECK(s.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(s.error_message().find(c.says) != std::string::npos);
  }
  ExpectAnswers(d);
}

}  // namespace
}  // namespace testing
}  // namespace ferry
