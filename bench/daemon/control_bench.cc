// control_bench: what large registrations and ExplainPlan cost the other
// callers of one ferryd (docs/api.md, "Limits").
//
// Starts an in-process ferryd on a temporary unix socket and measures:
//
//   lock      two source ranks of one stream, --params parameters each
//             (every rank declares every parameter and holds its row of
//             it), registered at once from two threads while a third calls
//             ListParticipants in a loop: each registration's time, and the
//             ListParticipants latency (median, max) while they run.
//             Target: ListParticipants max < 1 s.
//   explain   a destination with --explain_pieces explicit pieces (one per
//             parameter, tp_size 1) and one Inspection.ExplainPlan of it
//             (the first call plans), then a second call (plan cached).
//
//   bazel run -c opt //bench/daemon:control_bench -- [--params=50000]
//       [--explain_pieces=30000,100000]
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/daemon_options.h"
#include "daemon/server.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "proto/ferry/v1/registration.grpc.pb.h"
#include "tests/support/wire_registrations.h"
#include "common/flags_help.h"
#include "transport/shared_memory.h"

DEFINE_int32(params, 50000, "parameters per source rank (lock scenario)");
DEFINE_string(explain_pieces, "30000,100000",
              "explicit destination pieces per ExplainPlan run");
DEFINE_string(explain_layout, "params,columns",
              "params: one piece per parameter; columns: one parameter "
              "[2, pieces] cut into one-column pieces");

namespace ferry {
namespace {

using testing::kCols;
using testing::Source;
using testing::Destination;
using testing::WideSource;
using testing::WideDestination;

double Ms(absl::Duration d) { return absl::ToDoubleMilliseconds(d); }

struct Daemon {
  std::string dir;
  std::unique_ptr<Server> server;
  std::shared_ptr<grpc::Channel> channel;
  std::unique_ptr<v1::Registry::Stub> registry;
  std::unique_ptr<v1::Inspection::Stub> inspection;

  Daemon() {
    char tmpl[] = "/tmp/ferry-control-bench-XXXXXX";
    dir = ::mkdtemp(tmpl);
    DaemonOptions o;
    o.socket_path = dir + "/ferryd.sock";
    o.lease_ms = 600000;
    auto s = Server::Start(o);
    CHECK(s.ok()) << s.status();
    server = *std::move(s);
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    channel = grpc::CreateCustomChannel("unix:" + o.socket_path,
                                        grpc::InsecureChannelCredentials(),
                                        args);
    registry = v1::Registry::NewStub(channel);
    inspection = v1::Inspection::NewStub(channel);
  }
  ~Daemon() {
    server->Shutdown();
    ::rmdir(dir.c_str());
  }
};

void LockScenario(int params) {
  Daemon d;
  std::vector<std::unique_ptr<SharedMemoryRegion>> memory;
  std::vector<v1::RegisterSourceRequest> requests;
  for (int r = 0; r < 2; ++r) {
    auto m = SharedMemoryRegion::Create("control-bench",
                                        int64_t{params} * kCols * 4);
    CHECK(m.ok()) << m.status();
    memory.push_back(std::make_unique<SharedMemoryRegion>(*std::move(m)));
    requests.push_back(Source("lock", r, params, *memory.back()));
  }
  std::atomic<int> done{0};
  std::vector<double> register_ms(2);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      grpc::ClientContext c;
      v1::RegisterSourceResponse resp;
      const absl::Time t0 = absl::Now();
      grpc::Status s = d.registry->RegisterSource(&c, requests[r], &resp);
      register_ms[r] = Ms(absl::Now() - t0);
      if (!s.ok()) errors[r] = s.error_message().substr(0, 200);
      done.fetch_add(1);
    });
  }
  std::vector<double> list_ms;
  while (done.load() < 2) {
    grpc::ClientContext c;
    v1::ListParticipantsResponse resp;
    const absl::Time t0 = absl::Now();
    grpc::Status s =
        d.inspection->ListParticipants(&c, v1::ListParticipantsRequest(), &resp);
    list_ms.push_back(Ms(absl::Now() - t0));
    CHECK(s.ok()) << s.error_message();
    absl::SleepFor(absl::Milliseconds(5));
  }
  for (auto& t : threads) t.join();
  std::sort(list_ms.begin(), list_ms.end());
  std::printf("lock: 2 source ranks x %d parameters, registered at once\n",
              params);
  for (int r = 0; r < 2; ++r) {
    std::printf("  RegisterSource rank %d: %9.1f ms %s\n", r, register_ms[r],
                errors[r].empty() ? "ok" : errors[r].c_str());
  }
  std::printf(
      "  ListParticipants meanwhile: %zu calls, median %.1f ms, max %.1f ms "
      "(target max < 1000 ms)\n",
      list_ms.size(), list_ms[list_ms.size() / 2], list_ms.back());
}

void ExplainScenario(int pieces, bool columns) {
  Daemon d;
  std::vector<std::unique_ptr<SharedMemoryRegion>> memory;
  for (int r = 0; r < 2; ++r) {
    auto m = SharedMemoryRegion::Create("control-bench",
                                        int64_t{pieces} * kCols * 4);
    CHECK(m.ok()) << m.status();
    memory.push_back(std::make_unique<SharedMemoryRegion>(*std::move(m)));
    grpc::ClientContext c;
    v1::RegisterSourceResponse resp;
    grpc::Status s = d.registry->RegisterSource(
        &c,
        columns ? WideSource("explain", r, pieces, *memory.back())
                : Source("explain", r, pieces, *memory.back()),
        &resp);
    CHECK(s.ok()) << s.error_message().substr(0, 300);
  }
  auto m = SharedMemoryRegion::Create("control-bench",
                                      int64_t{pieces} * 2 * kCols * 4);
  CHECK(m.ok()) << m.status();
  {
    grpc::ClientContext c;
    v1::RegisterDestinationResponse resp;
    const absl::Time t0 = absl::Now();
    grpc::Status s = d.registry->RegisterDestination(
        &c,
        columns ? WideDestination("explain", "explain-0", pieces, *m)
                : Destination("explain", "explain-0", pieces, *m),
        &resp);
    CHECK(s.ok()) << s.error_message().substr(0, 300);
    std::printf(
        "explain: %d explicit pieces (%s); RegisterDestination %.1f ms\n",
        pieces, columns ? "one-column pieces of one parameter"
                        : "one piece per parameter",
        Ms(absl::Now() - t0));
  }
  for (int round = 0; round < 2; ++round) {
    grpc::ClientContext c;
    c.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(5));
    v1::ExplainPlanRequest req;
    req.set_instance_id("explain-0");
    v1::ExplainPlanResponse resp;
    const absl::Time t0 = absl::Now();
    grpc::Status s = d.inspection->ExplainPlan(&c, req, &resp);
    std::printf("  ExplainPlan %s: %9.1f ms, %s, %d rows\n",
                round == 0 ? "(plans)" : "(cached)", Ms(absl::Now() - t0),
                s.ok() ? "ok" : s.error_message().substr(0, 200).c_str(),
                resp.parameters_size());
  }
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  google::InitGoogleLogging(argv[0]);
  FLAGS_minloglevel = 1;
  if (FLAGS_params > 0) ferry::LockScenario(FLAGS_params);
  for (absl::string_view n : absl::StrSplit(FLAGS_explain_pieces, ',',
                                            absl::SkipEmpty())) {
    int pieces = 0;
    if (!absl::SimpleAtoi(n, &pieces) || pieces <= 0) continue;
    for (absl::string_view layout : absl::StrSplit(FLAGS_explain_layout, ',',
                                                   absl::SkipEmpty())) {
      ferry::ExplainScenario(pieces, layout == "columns");
    }
  }
  return 0;
}
