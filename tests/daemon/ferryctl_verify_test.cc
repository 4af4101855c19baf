// `ferryctl verify`, `reload` and `config` as a user runs them: the real
// ferryctl binary (from the runfiles) against an in-process ferryd on a
// unix socket, with a TP2 trainer and TP4 instances (daemon_test_support).
// verify: exit 0 clean, 1 on mismatches, 2 on errors; one line per
// mismatch.
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

std::string FerryctlPath() {
  for (const char* var : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    const char* dir = std::getenv(var);
    if (dir == nullptr) continue;
    const std::string path =
        std::string(dir) + "/ferry/client/ferryctl/ferryctl";
    if (access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

struct Run {
  int exit = -1;
  std::string output;  // stdout and stderr
};

Run Ferryctl(const TestDaemon& d, const std::string& args) {
  const std::string binary = FerryctlPath();
  REQUIRE_FALSE(binary.empty());
  const std::string cmd = binary + " --daemon=unix:" + d.options.socket_path +
                          " " + args + " 2>&1";
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
    CHECK(Has(run.output, "  verify        checksums"));
  }

  for (auto& e : engines) e->Stop();
}

TEST_CASE("ferryctl reload and config", "[ferryctl][lifecycle]") {
  TestDaemon d;
  std::vector<std::unique_ptr<TrainerRank>> trainers;
  for (int r = 0; r < 2; ++r) {
    trainers.push_back(std::make_unique<TrainerRank>(r, "policy"));
    RegisterSource(d, *trainers.back());
  }
  std::vector<std::unique_ptr<EngineRank>> engines;
  for (const char* id : {"a", "b"}) {
    for (int r = 0; r < 4; ++r) {
      engines.push_back(std::make_unique<EngineRank>(id, r, "policy"));
      engines.back()->lm_head_direct = std::string(id) == "a";
      RegisterDestination(d, *engines.back());
      engines.back()->Run(d.versions.get());
    }
  }
  std::vector<EngineRank*> all;
  for (auto& e : engines) all.push_back(e.get());
  ExpectVersionCommits(d, {trainers[0].get(), trainers[1].get()}, all, 1, 2);

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

}  // namespace testing
}  // namespace ferry
