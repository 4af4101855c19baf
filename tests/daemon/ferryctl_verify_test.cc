// `ferryctl verify` as a user runs it: the real ferryctl binary (from the
// runfiles) against an in-process ferryd on a unix socket, with a TP2
// trainer and a TP4 instance (daemon_test_support). Exit 0 clean, 1 on
// mismatches, 2 on errors; one line per mismatch.
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
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

}  // namespace testing
}  // namespace ferry
