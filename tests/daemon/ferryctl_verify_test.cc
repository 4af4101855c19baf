// ferryctl as a user runs it: the real binary (from the runfiles) against
// an in-process ferryd on a unix socket, with a TP2 trainer and TP4
// instances (daemon_test_support). verify: exit 0 clean, 1 on mismatches,
// 2 on errors; one line per mismatch. reload and config; versions; --json
// on every command; each command's own --help, and every binary's --help
// listing its own flags only.
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "nlohmann/json.hpp"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

// A binary of the workspace, from the runfiles ("client/ferryctl/ferryctl").
std::string BinaryPath(const std::string& target) {
  for (const char* var : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* dir = std::getenv(var);
    if (dir == nullptr) continue;
    const std::string path = std::string(dir) + "/ferry/" + target;
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

std::string FerryctlPath() { return BinaryPath("client/ferryctl/ferryctl"); }

struct Run {
  int exit = -1;
  std::string output;  // stdout and stderr
};

// Runs `binary args`; stdout (and stderr, unless `stdout_only`).
Run RunBinary(const std::string& binary, const std::string& args,
              bool stdout_only = false) {
  REQUIRE_FALSE(binary.empty());
  const std::string cmd =
      binary + " " + args + (stdout_only ? " 2>/dev/null" : " 2>&1");
  Run run;
  FILE* p = popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) run.output.append(buf, n);
  const int status = pclose(p);
  run.exit = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return run;
}

Run Ferryctl(const TestDaemon& d, const std::string& args,
             bool stdout_only = false) {
  return RunBinary(FerryctlPath(),
                   "--daemon=unix:" + d.options.socket_path + " " + args,
                   stdout_only);
}

bool Has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

}  // namespace

TEST_CASE("ferryctl verify: clean, a mismatch, errors", "[ferryctl][verify]") {
  DaemonOptions options;
  options.transfer_checksums = true;
  TestDaemon daemon(options);
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    RegisterSource(daemon, *trainers.back());
  }
  std::vector<EngineRank*> ranks;
  for (int r = 0; r < 4; ++r) {
    engines.push_back(std::make_unique<EngineRank>("vllm-0", r, "policy"));
    RegisterDestination(daemon, *engines.back());
    engines.back()->Run(daemon.versions.get());
    ranks.push_back(engines.back().get());
  }

  SECTION("before any version: an error, exit 2") {
    const Run run = Ferryctl(daemon, "verify --instance=vllm-0");
    INFO(run.output);
    CHECK(run.exit == 2);
    CHECK(Has(run.output, "no checksums kept"));
    CHECK(Has(run.output, "FAILED_PRECONDITION"));
  }

  SECTION("after commits") {
    ExpectVersionCommits(daemon, {trainers[0].get(), trainers[1].get()},
                         ranks, 1, 1);
    ExpectVersionCommits(daemon, {trainers[0].get(), trainers[1].get()},
                         ranks, 2, 1);
    Run run = Ferryctl(daemon, "verify --instance=vllm-0");
    INFO(run.output);
    CHECK(run.exit == 0);
    CHECK(Has(run.output,
              "instance vllm-0 at version 2: 5 parameters, 1.38 KiB checked, "
              "0 mismatches, 2.00 KiB not verified\n"));
    CHECK(Has(run.output, "(lm_head.weight): not verifiable (fallback)"));

    // down_proj[6, 9] lives on tp rank 2 (columns 8..11) at float
    // 48 + 6 * 4 + 1.
    reinterpret_cast<float*>(engines[2]->memory->data())[48 + 6 * 4 + 1] = -3;
    run = Ferryctl(daemon, "verify --instance=vllm-0");
    INFO(run.output);
    CHECK(run.exit == 1);
    CHECK(Has(run.output, ", 1 mismatch,"));
    CHECK(Has(run.output,
              "  MISMATCH model.layers.0.mlp.down_proj.weight tp rank 2 box "
              "[0:8, 8:12] on localhost: expected "));
    int lines = 0;
    for (size_t at = run.output.find("MISMATCH"); at != std::string::npos;
         at = run.output.find("MISMATCH", at + 1)) {
      ++lines;
    }
    CHECK(lines == 1);

    run = Ferryctl(daemon, "verify --instance=vllm-0 --json");
    INFO(run.output);
    CHECK(run.exit == 1);
    CHECK(Has(run.output, "\"mismatches\""));
    CHECK(Has(run.output, "\"tp_rank\": 2"));
  }

  SECTION("usage and unknown instances") {
    Run run = Ferryctl(daemon, "verify");
    CHECK(run.exit == 2);
    CHECK(Has(run.output, "--instance=ID is required"));
    run = Ferryctl(daemon, "verify --instance=nope");
    CHECK(run.exit == 2);
    CHECK(Has(run.output, "NOT_FOUND"));
    run = Ferryctl(daemon, "verify --help");
    CHECK(run.exit == 0);
    CHECK(Has(run.output, "usage: ferryctl"));
    CHECK(Has(run.output, "exit: 0 every compared box matches, 1 mismatches"));
    run = Ferryctl(daemon, "--help");
    CHECK(run.exit == 0);
    CHECK(Has(run.output, "  verify          checksums"));
  }

  for (auto& e : engines) e->Stop();
}

// A TP2 trainer and two TP4 instances following "policy", every rank
// running: "a" takes every byte direct, "b" takes lm_head through its
// loader unless `b_lm_head_direct`.
struct Fleet {
  explicit Fleet(bool b_lm_head_direct) {
    for (int r = 0; r < 2; ++r) {
      trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
      RegisterSource(d, *trainers.back());
    }
    for (const char* id : {"a", "b"}) {
      for (int r = 0; r < 4; ++r) {
        engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
        engines.back()->lm_head_direct =
            std::string(id) == "a" || b_lm_head_direct;
        RegisterDestination(d, *engines.back());
        engines.back()->Run(d.versions.get());
      }
    }
  }
  ~Fleet() {
    for (auto& e : engines) e->Stop();
  }
  // Version v commits on both instances, every byte checked.
  void Commit(int64_t v) {
    std::vector<EngineRank*> all;
    for (auto& e : engines) all.push_back(e.get());
    ExpectVersionCommits(d, {trainers[0].get(), trainers[1].get()}, all, v, 2);
  }

  TestDaemon d;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  std::vector<std::unique_ptr<EngineRank>> engines;
};

TEST_CASE("ferryctl reload and config", "[ferryctl][lifecycle]") {
  Fleet f(/*b_lm_head_direct=*/false);
  TestDaemon& d = f.d;
  auto& engines = f.engines;
  f.Commit(1);

  Run run = Ferryctl(d, "config --instance=b");
  INFO(run.output);
  CHECK(run.exit == 0);
  CHECK(run.output ==
        "instance b load options:\n  load_format = auto\n"
        "  serve_as_peer = true\n");
  run = Ferryctl(d, "config --instance=b --set=load_format=fallback_only");
  CHECK(run.exit == 0);
  CHECK(Has(run.output, "load_format = fallback_only"));
  run = Ferryctl(d, "config --instance=b --set=load_format=maybe");
  CHECK(run.exit == 1);
  CHECK(Has(run.output, "value 'maybe' is not one of auto, direct_only, "
                        "fallback_only [INVALID_ARGUMENT]"));
  run = Ferryctl(d, "config --instance=b --set=load_format");
  CHECK(run.exit == 2);
  run = Ferryctl(d, "config --instance=b --clear=load_format");
  CHECK(Has(run.output, "load_format = auto"));

  // b scribbled over; reloaded from a (every byte direct).
  for (int r = 4; r < 8; ++r) {
    std::memset(engines[r]->memory->data(), 0, engines[r]->memory->size());
  }
  run = Ferryctl(d, "reload --instance=b");
  INFO(run.output);
  CHECK(run.exit == 0);
  CHECK(run.output == "instance b reloaded at version 1: COMMITTED\n");
  for (int r = 4; r < 8; ++r) CHECK(engines[r]->Check(1) == "");
  run = Ferryctl(d, "streams");
  CHECK(Has(run.output, "last reload b <- a v1"));
  // a's only possible peer, b, takes lm_head through its loader.
  run = Ferryctl(d, "reload --instance=a");
  CHECK(run.exit == 1);
  CHECK(Has(run.output, "b receives lm_head.weight through its loader"));
  CHECK(Ferryctl(d, "reload").exit == 2);
  for (auto& e : engines) e->Stop();
}

TEST_CASE("ferryctl offload and onload; streams and participants show it",
          "[ferryctl][lifecycle]") {
  Fleet f(/*b_lm_head_direct=*/true);
  TestDaemon& d = f.d;
  for (auto& e : f.engines) e->registry = d.registry.get();
  f.Commit(1);
  Run run = Ferryctl(d, "offload --instance=b --keep_host_copy");
  INFO(run.output);
  CHECK(run.exit == 0);
  CHECK(run.output == "instance b offloaded: OFFLOADED at version 1\n");
  run = Ferryctl(d, "streams");
  UNSCOPED_INFO(run.output);
  CHECK(Has(run.output, "host copy 16.00 KiB of version 1"));
  CHECK(Has(run.output, "last offload b -> host copy v1"));
  run = Ferryctl(d, "participants");
  CHECK(Has(run.output, "offloaded"));
  run = Ferryctl(d, "offload --instance=b");
  CHECK(run.exit == 1);
  CHECK(Has(run.output, "already offloaded [FAILED_PRECONDITION]"));
  run = Ferryctl(d, "onload --instance=b --json");
  CHECK(run.exit == 0);
  CHECK(Has(run.output, "\"state\": \"INSTANCE_STATE_COMMITTED\""));
  for (int r = 4; r < 8; ++r) CHECK(f.engines[r]->Check(1) == "");
  run = Ferryctl(d, "onload --instance=b");
  CHECK(run.exit == 1);
  CHECK(Has(run.output, "not offloaded"));
  CHECK(Ferryctl(d, "offload").exit == 2);
  f.Commit(2);
}

TEST_CASE("ferryctl versions, --json on every command", "[ferryctl]") {
  Fleet f(/*b_lm_head_direct=*/true);
  TestDaemon& d = f.d;
  auto& engines = f.engines;
  auto& trainers = f.trainers;
  f.Commit(1);
  f.Commit(2);
  // Version 3: instance b's rank 2 fails APPLY; a commits.
  engines[6]->fail_kind = v1::UPDATE_EVENT_KIND_APPLY;
  engines[6]->fail_version = 3;
  RunVersion(d, {trainers[0].get(), trainers[1].get()}, 3);
  engines[6]->fail_version = 0;  // b may be reloaded from a below

  Run run = Ferryctl(d, "versions --stream=policy");
  INFO(run.output);
  CHECK(run.exit == 0);
  const size_t v3 = run.output.find("v3 "), v2 = run.output.find("v2 "),
               v1 = run.output.find("v1 ");
  REQUIRE(v3 != std::string::npos);
  REQUIRE(v2 != std::string::npos);
  REQUIRE(v1 != std::string::npos);
  CHECK((v3 < v2 && v2 < v1));  // newest first
  CHECK(Has(run.output.substr(v3, v2 - v3), "partial"));
  CHECK(Has(run.output.substr(v3, v2 - v3), "1/2"));
  CHECK(Has(run.output, "b aborted (dirty): tp rank 2 failed APPLY"));
  CHECK(Has(run.output.substr(v2, v1 - v2), "committed"));
  CHECK(Ferryctl(d, "versions").exit == 2);  // --stream is required
  CHECK(Ferryctl(d, "versions --stream=nope").exit == 1);

  // --json: every command prints one JSON document on stdout.
  // probe: the standard gRPC health service says SERVING.
  run = Ferryctl(d, "probe");
  CHECK(run.exit == 0);
  CHECK(run.output == "SERVING\n");

  const std::vector<std::string> commands = {
      "participants", "streams", "versions --stream=policy", "probe",
      "plan --instance=a", "health", "config --instance=a",
      "watch --stream=policy --watch_version=2", "reload --instance=b"};
  for (const std::string& c : commands) {
    INFO(c);
    run = Ferryctl(d, c + " --json", /*stdout_only=*/true);
    CHECK(run.exit == 0);
    nlohmann::json j;
    REQUIRE_NOTHROW(j = nlohmann::json::parse(run.output));
    CHECK(j.is_object());
  }
  const nlohmann::json versions = nlohmann::json::parse(
      Ferryctl(d, "versions --stream=policy --json", true).output);
  // Versions only: the reload is a peer delivery (`streams` shows it).
  REQUIRE(versions["versions"].size() == 3);
  CHECK(versions["versions"][0]["version"] == "3");  // int64 as a string
  CHECK(versions["versions"][0]["instances_aborted"] == 1);
  for (auto& e : engines) e->Stop();
}

TEST_CASE("each ferryctl command has its own --help; every binary's --help "
          "lists its own flags", "[ferryctl][help]") {
  Run run = RunBinary(FerryctlPath(), "--help");
  CHECK(run.exit == 0);
  for (const char* verb : {"participants", "streams", "versions", "plan",
                           "watch", "health", "probe", "reload", "config",
                           "verify"}) {
    CHECK(Has(run.output, std::string("\n  ") + verb + " "));
  }
  run = RunBinary(FerryctlPath(), "versions --help");
  CHECK(run.exit == 0);
  CHECK(Has(run.output, "usage: ferryctl [--daemon=unix:PATH|host:port] versions"));
  CHECK(Has(run.output, "--stream"));
  CHECK_FALSE(Has(run.output, "--instance"));
  run = RunBinary(FerryctlPath(), "help plan");
  CHECK(Has(run.output, "--tp_rank"));
  CHECK_FALSE(Has(run.output, "--watch_version"));
  // No glog or gflags flags in anyone's help.
  const std::vector<std::pair<std::string, std::string>> binaries = {
      {"daemon/ferryd", "--metrics_address"},
      {"tools/ferry_plan", "--trainer"},
      {"tools/ferry_load", "--explain"},
      {"client/ferryctl/ferryctl", "--daemon"}};
  for (const auto& [binary, own] : binaries) {
    INFO(binary);
    run = RunBinary(BinaryPath(binary), "--help");
    CHECK(run.exit == 0);
    CHECK(Has(run.output, own));
    CHECK_FALSE(Has(run.output, "alsologtostderr"));
    CHECK_FALSE(Has(run.output, "flagfile"));
  }
}

}  // namespace testing
}  // namespace ferry
