// Test support for ferryd: an in-process daemon on a unix socket in a temp
// directory, a small model with known bytes, trainer ranks that register
// /dev/shm regions, and engine ranks that follow their Subscribe stream
// from a thread (acking, reading fallback tensors from staging).
#ifndef FERRY_TESTS_DAEMON_DAEMON_TEST_SUPPORT_H_
#define FERRY_TESTS_DAEMON_DAEMON_TEST_SUPPORT_H_

#include <atomic>
#include <map>
#include <functional>
#include <memory>
#include <optional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon/daemon_options.h"
#include "daemon/server.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "proto/ferry/v1/lifecycle.grpc.pb.h"
#include "proto/ferry/v1/registration.grpc.pb.h"
#include "proto/ferry/v1/version.grpc.pb.h"
#include "transport/device_memory.h"
#include "transport/shared_memory.h"

namespace ferry {
namespace testing {

// A fresh directory under /tmp (short enough for a unix socket path).
std::string MakeTempDir();

// ferryd in this process, serving a unix socket in a temp directory.
struct TestDaemon {
  // `devices` null: the node's own (none here, or real GPUs).
  explicit TestDaemon(DaemonOptions options = DaemonOptions(),
                      std::unique_ptr<DeviceMemory> devices = nullptr);
  ~TestDaemon();
  std::shared_ptr<grpc::Channel> Connect() const;

  std::string dir;
  DaemonOptions options;
  std::unique_ptr<Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Registry::Stub> registry;
  std::unique_ptr<v1::Versions::Stub> versions;
  std::unique_ptr<v1::Inspection::Stub> inspection;
  std::unique_ptr<v1::Lifecycle::Stub> lifecycle;
};

// Two nodes in this process: a coordinator "node-a" and a member "node-b"
// that has joined it (each with its own DeviceMemory when given, both with
// `base`'s options, or the member with `member_base`'s, but node names and
// coordinator address).
struct TwoNodes {
  explicit TwoNodes(std::unique_ptr<DeviceMemory> a_devices = nullptr,
                    std::unique_ptr<DeviceMemory> b_devices = nullptr,
                    const DaemonOptions& base = DaemonOptions(),
                    std::optional<DaemonOptions> member_base = std::nullopt);
  TestDaemon a, b;
};

// A coordinator "node-a" and `members` member daemons "node-b",
// "node-c", ... that have joined it, all with `base`'s options but node
// names and coordinator address.
struct Nodes {
  Nodes(int members, const DaemonOptions& base = DaemonOptions());
  std::unique_ptr<TestDaemon> coordinator;
  std::vector<std::unique_ptr<TestDaemon>> members;
};

// The test model: q/k/v [8, 8], down_proj [8, 16], norm [8], lm_head
// [16, 8], all F32. Value of element `flat` of parameter `p` at version v.
struct TestParam {
  std::string name;
  std::vector<int64_t> shape;
};
const std::vector<TestParam>& TestModel();
float ValueAt(int param, int64_t flat, int64_t version);
// Delta versions' tests change only some elements from one version to the
// next: while set, ValueAt (the trainers' Fill and the engines' Check)
// answers `fn` instead. Set it before the first version; null restores.
void SetValueFunction(std::function<float(int, int64_t, int64_t)> fn);

// A trainer rank of a TP2 trainer (column shards of q/k/v, row shards of
// down_proj, vocab rows of lm_head, the norm replicated).
class TrainerRank {
 public:
  TrainerRank(int rank, const std::string& stream);
  // Writes version v's values into its shared memory.
  void Fill(int64_t version);
  v1::RegisterSourceRequest Registration() const;

  int rank;
  std::string stream;
  struct Slice {
    int param;
    std::vector<int64_t> offset, extent;
    int64_t byte_offset;
  };
  std::vector<Slice> slices;
  std::unique_ptr<SharedMemoryRegion> memory;
  // Set: register `memory` as GPU memory of this GPU (host_backed_gpus.h).
  std::string gpu_uuid;
  v1::ParticipantHandle handle;
};

// One TP rank of a TP4 (or, with tp_size, TP2 or TP8) engine instance with
// an engine table: fused qkv, row-parallel down_proj, replicated norm, and
// lm_head with a custom loader (fallback, read from staging at APPLY), or
// with lm_head_direct a vocab-parallel lm_head (every byte direct, no
// staging).
class EngineRank {
 public:
  EngineRank(const std::string& instance, int tp_rank,
             const std::string& stream);
  ~EngineRank();
  v1::RegisterDestinationRequest Registration() const;

  // Follows the Subscribe stream on a thread until Stop.
  void Run(v1::Versions::Stub* versions);
  void Stop();

  // Checks every live byte and the lm_head loaded from staging against
  // version v; returns "" or a description of the first mismatch.
  std::string Check(int64_t version) const;

  // Stop acking events of this kind at this version (simulated hang).
  std::atomic<int64_t> hang_version{0};
  std::atomic<int> hang_kind{0};
  // Ack FAILED for events of this kind at this version.
  std::atomic<int64_t> fail_version{0};
  std::atomic<int> fail_kind{0};
  // OFFLOAD: the rank drops `memory` (unmapped and unlinked); ONLOAD: it
  // creates a new region (zeros) and registers it with UpdateRegions on
  // `registry` (set before Run) before acking; with no `registry` it acks
  // without registering anything (a careless client). `offloaded` in
  // between.
  v1::Registry::Stub* registry = nullptr;
  std::atomic<bool> offloaded{false};
  std::atomic<int> onloads{0};

  std::string instance;
  int tp_rank;
  std::string stream;
  std::unique_ptr<SharedMemoryRegion> memory;
  // Set: register `memory` as GPU memory of this GPU (host_backed_gpus.h).
  std::string gpu_uuid;
  bool lm_head_direct = false;  // set before Registration()
  // Set before Registration(): ask for device staging (a GPU rank). The
  // APPLY's cuda_ipc staging regions are then opened through the
  // host-backed GPUs' handles (shared memory names), and their kinds kept
  // in staging_kinds.
  bool device_staging = false;
  int tp_size = 4;              // set before Registration(): 2, 4 or 8
  v1::ParticipantHandle handle;

  mutable std::mutex mu;
  std::vector<float> loaded_lm_head;  // as the engine's own loader took it
  // Parameters the last APPLY listed as fallback tensors: the loader put
  // each into the live buffers (lm_head, unless lm_head_direct, into
  // loaded_lm_head), sharded as the engine's own loader would.
  std::vector<std::string> last_fallbacks;
  std::vector<std::string> log;       // "PREPARE 1", "COMMIT 1", ...
  // Per staging region of the last APPLY: "host", or "cuda:<uuid>".
  std::vector<std::string> staging_kinds;
  int64_t committed = 0;

 private:
  // The engine's loader for one full checkpoint tensor from staging.
  void Load(const std::string& name, const float* full, int64_t floats);

  std::unique_ptr<grpc::ClientContext> context_;
  std::thread thread_;
  std::map<uint32_t, std::unique_ptr<SharedMemoryRegion>> staging_;
};

// Registers, or fails the test.
void RegisterSource(TestDaemon& d, TrainerRank& t);
void RegisterDestination(TestDaemon& d, EngineRank& e);

// Runs version v from every trainer rank (Fill, Begin, Commit, on threads);
// returns each rank's CommitVersion outcome.
std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>> RunVersion(
    TestDaemon& d, std::vector<TrainerRank*> trainers, int64_t version);

// Runs version v from `trainers` and checks what users see: every
// CommitVersion OK with `instances` instances, each COMMITTED at v and
// clean; every engine rank told COMMIT v and holding v's bytes (checked
// against the trainer's values).
void ExpectVersionCommits(TestDaemon& d, std::vector<TrainerRank*> trainers,
                          const std::vector<EngineRank*>& engines, int64_t v,
                          int instances);

// Truncates the named shm object under every mapping of it (a client that
// shrinks its registered memory).
void Shrink(const SharedMemoryRegion& region);

// GetProgress of version v of `stream` on `d` (empty when it fails).
v1::GetProgressResponse ProgressOf(TestDaemon& d, const std::string& stream,
                                   int64_t version);

// Instance `id`'s state in version v of `stream`, as GetProgress on `d`
// reports it (UNSPECIFIED when it cannot say).
v1::InstanceState StateOf(TestDaemon& d, const std::string& stream,
                          int64_t version, const std::string& id);

// Acks, on `d`, the event of `kind` that `rank` holds (hang_kind) in
// version v, trying event ids 1 to 8; whether one was taken.
bool AckHeld(TestDaemon& d, const EngineRank& rank, v1::UpdateEventKind kind,
             int64_t version);

// Every rank's CommitVersion succeeded and every instance committed.
void ExpectAllCommitted(
    const std::vector<std::pair<grpc::Status, v1::CommitVersionResponse>>&
        outcome);

// Checks that the daemon still answers GetHealth (limits_test.cc has a
// stronger ExpectHealthy: a fresh stream commits a version).
void ExpectAnswers(TestDaemon& d);

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_DAEMON_DAEMON_TEST_SUPPORT_H_
