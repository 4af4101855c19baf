// cross_node_bench: what one version costs between two nodes, end to end
// through two real ferryd processes on loopback, against a raw loopback TCP
// stream of the same byte count.
//
// Starts daemon A (coordinator) and daemon B (member, --coordinator=A) as
// child processes (//daemon:ferryd from runfiles, or --ferryd), each on its
// own unix socket and a 127.0.0.1 TCP port. In this process it registers
// one source rank on A and one destination rank (same layout: a few large
// bf16 tensors, ~512 MiB, one direct piece each) on B, so every byte
// crosses A->B over a channel between the daemons, and times --versions
// versions from BeginVersion to every instance committed (PublishVersion).
// It does so once per --channels kind (a fresh daemon pair each): ferry's
// TCP channel, and UCX channels over UCX's tcp and shared-memory
// transports (--ucx_nodes=* --ucx_transports=...). In the same
// run it times a plain blocking-socket send/recv of the same byte count
// between two threads (kernel default socket options), --raw_runs times;
// ferry's median is compared with the raw stream's median, best with best.
//
// On loopback both daemons, this process and the kernel's copies share the
// machine's cores (2 here), so the figures are CPU-bound, not NIC-bound.
// Target: update >= 0.7x the raw stream.
//
//   bazel run -c opt //bench/daemon:cross_node_bench -- [--versions=N]
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "bench/daemon/bench_figures.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "client/destination_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "tests/daemon/test_certs.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "common/flags_help.h"

DEFINE_int64(model_mib, 512, "size of the model, MiB");
DEFINE_int64(tensor_mib, 64, "size of each tensor, MiB");
DEFINE_int32(versions, 5, "versions to time");
DEFINE_int32(raw_runs, 5, "runs of the raw loopback stream to time");
DEFINE_string(ferryd, "", "path of ferryd (default: from runfiles)");
DEFINE_string(delta_densities, "",
              "delta versions (issue 42): after the channel kinds, one daemon "
              "pair with --delta_shadow_mb per density listed (e.g. "
              "0.01,0.05,1), each version changing that fraction of the bf16 "
              "elements; time and wire bytes per version (version 1, dense, "
              "not counted) against the TCP kind above. Empty: none.");
DEFINE_string(channels, "tcp,ucx:tcp,ucx:sm",
              "the daemons' channel kinds to time, one daemon pair each: tcp "
              "(ferry's TCP channel) or ucx:<UCX_TLS> (--ucx_nodes=* "
              "--ucx_transports=<UCX_TLS>)");

namespace ferry {
namespace {

using bench::Median;
using bench::RawLoopbackSeconds;

constexpr int64_t kMiB = int64_t{1} << 20;

std::string FindFerryd(const char* argv0) {
  if (!FLAGS_ferryd.empty()) return FLAGS_ferryd;
  std::vector<std::string> candidates;
  for (const char* var : {"RUNFILES_DIR", "TEST_SRCDIR"}) {
    if (const char* dir = std::getenv(var)) {
      candidates.push_back(absl::StrCat(dir, "/ferry/daemon/ferryd"));
    }
  }
  candidates.push_back(absl::StrCat(argv0, ".runfiles/ferry/daemon/ferryd"));
  char exe[4096];
  const ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    exe[n] = '\0';
    candidates.push_back(absl::StrCat(exe, ".runfiles/ferry/daemon/ferryd"));
  }
  candidates.push_back("daemon/ferryd");  // bazel run's cwd: the runfiles
  for (const std::string& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) return c;
  }
  return "";
}

// A child ferryd; SIGKILLed and reaped on destruction.
class Daemon {
 public:
  Daemon(const std::string& binary, const std::string& dir,
         const std::string& node, const std::string& coordinator,
         const std::vector<std::string>& extra_flags) {
    socket_ = dir + "/" + node + ".sock";
    port_file_ = dir + "/" + node + ".port";
    log_ = dir + "/" + node + ".log";
    std::vector<std::string> args = {binary,
                                     "--node=" + node,
                                     "--socket=" + socket_,
                                     "--listen=127.0.0.1:0",
                                     "--port_file=" + port_file_,
                                     "--version_timeout_ms=120000",
                                     "--ack_timeout_ms=60000",
                                     "--logtostderr"};
    // Between daemons: mutual TLS, with certificates made for the run.
    for (const std::string& f : ferry::testing::TlsFlags(node)) {
      args.push_back(f);
    }
    if (!coordinator.empty()) args.push_back("--coordinator=" + coordinator);
    for (const std::string& f : extra_flags) args.push_back(f);
    // The child reopens stdout: what this process buffered must not be
    // flushed a second time from there.
    std::fflush(nullptr);
    pid_ = fork();
    if (pid_ == 0) {
      FILE* out = std::freopen(log_.c_str(), "w", stdout);
      if (out != nullptr) dup2(fileno(stdout), STDERR_FILENO);
      std::vector<char*> argv;
      for (std::string& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      execv(binary.c_str(), argv.data());
      _exit(127);
    }
  }
  ~Daemon() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    unlink(port_file_.c_str());
    unlink(socket_.c_str());
  }
  // Waits for the port file; 0 on timeout.
  int WaitPort(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      std::ifstream in(port_file_);
      int port = 0;
      if (in >> port && port > 0) return port;
      absl::SleepFor(absl::Milliseconds(20));
    }
    return 0;
  }
  const std::string& socket() const { return socket_; }
  const std::string& log() const { return log_; }

 private:
  pid_t pid_ = -1;
  std::string socket_, port_file_, log_;
};

struct Model {
  ModelSpec spec;
  std::vector<Piece> pieces;
  int64_t bytes = 0;
};

Model MakeModel(int64_t total_bytes, int64_t tensor_bytes) {
  Model m;
  constexpr int64_t kCols = 4096;
  const int64_t rows = std::max<int64_t>(1, tensor_bytes / (kCols * 2));
  const int64_t tensors =
      std::max<int64_t>(1, total_bytes / (rows * kCols * 2));
  for (int64_t i = 0; i < tensors; ++i) {
    m.spec.params.push_back(ParamSpec{absl::StrCat("layers.", i, ".weight"),
                                      DType::kBF16, {rows, kCols}});
  }
  m.spec.BuildIndex();
  for (int64_t i = 0; i < tensors; ++i) {
    m.pieces.push_back(Piece::Contiguous(static_cast<int32_t>(i),
                                         FullBox(m.spec.params[i].shape), 0,
                                         m.bytes, DType::kBF16));
    m.bytes += rows * kCols * 2;
  }
  return m;
}

absl::StatusOr<Connection> Connect(const std::string& address) {
  ConnectionOptions o;
  o.address = address;
  o.rpc_timeout = absl::Seconds(30);
  absl::StatusOr<Connection> c = Connection::Open(o);
  if (!c.ok()) return c.status();
  absl::Status ready = c->WaitForReady(absl::Seconds(30));
  if (!ready.ok()) return ready;
  return c;
}

bool Eventually(const std::function<bool()>& done, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  while (absl::Now() < deadline) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return done();
}

bool MemberReachable(const Connection& c) {
  v1::GetHealthResponse h;
  auto context = c.NewContext(absl::Seconds(2));
  if (!c.inspection().GetHealth(context.get(), {}, &h).ok()) return false;
  for (const v1::PeerHealth& p : h.peers()) {
    if (p.reachable()) return true;
  }
  return false;
}

bool InstanceComplete(const Connection& c, const std::string& stream) {
  v1::ListStreamsRequest request;
  request.set_stream(stream);
  v1::ListStreamsResponse response;
  auto context = c.NewContext(absl::Seconds(2));
  if (!c.inspection().ListStreams(context.get(), request, &response).ok() ||
      response.streams_size() != 1) {
    return false;
  }
  for (const v1::InstanceInfo& i : response.streams(0).instances()) {
    if (i.registered_tp_ranks_size() == i.tp_size()) return true;
  }
  return false;
}

[[noreturn]] void Die(const char* what) {
  std::perror(what);
  std::exit(1);
}

// Version v's change: `density` of the bf16 elements (every
// 1/density-th, from an offset that moves per version) bumped by one;
// negative: the first and last byte only.
void Change(SharedTensorArena& src, const Model& model, int v,
            double density) {
  if (density < 0) {
    src.data()[0] = static_cast<uint8_t>(v);
    src.data()[model.bytes - 1] = static_cast<uint8_t>(v + 100);
    return;
  }
  if (density == 0) return;
  const int64_t stride =
      std::max<int64_t>(1, static_cast<int64_t>(1 / density));
  uint16_t* e = reinterpret_cast<uint16_t*>(src.data());
  for (int64_t i = v % stride; i < model.bytes / 2; i += stride) ++e[i];
}

// The bytes version v of `stream` put on the wire into its instances (a
// patched bucket's patch, every other bucket's bytes); -1 when unknown.
int64_t WireBytes(const Connection& c, const std::string& stream, int v) {
  v1::GetProgressRequest request;
  request.set_stream(stream);
  request.set_version(v);
  v1::GetProgressResponse response;
  auto context = c.NewContext(absl::Seconds(5));
  if (!c.inspection().GetProgress(context.get(), request, &response).ok()) {
    return -1;
  }
  int64_t wire = 0;
  for (const v1::InstanceProgress& i : response.instances()) {
    wire += i.bytes_moved() - i.patched_bytes() + i.patch_bytes();
  }
  return wire;
}

// One daemon pair with `flags`, the model registered across it, and
// --versions versions timed (seconds each; the bytes each put on the wire
// into `wire` if given), every byte checked; empty on failure (logged).
std::vector<double> TimeVersions(const std::string& ferryd,
                                 const std::string& dir,
                                 const std::vector<std::string>& flags,
                                 const Model& model, SharedTensorArena& src,
                                 SharedTensorArena& dst,
                                 double density = -1,
                                 std::vector<int64_t>* wire = nullptr) {
  Daemon a(ferryd, dir, "node-a", "", flags);
  const int a_port = a.WaitPort(absl::Seconds(30));
  if (a_port == 0) {
    LOG(ERROR) << "node-a did not start; log " << a.log();
    return {};
  }
  Daemon b(ferryd, dir, "node-b", absl::StrCat("127.0.0.1:", a_port), flags);
  if (b.WaitPort(absl::Seconds(30)) == 0) {
    LOG(ERROR) << "node-b did not start; log " << b.log();
    return {};
  }
  absl::StatusOr<Connection> conn_a = Connect("unix:" + a.socket());
  absl::StatusOr<Connection> conn_b = Connect("unix:" + b.socket());
  if (!conn_a.ok() || !conn_b.ok()) {
    LOG(ERROR) << "cannot reach the daemons; logs in " << dir;
    return {};
  }
  if (!Eventually([&] { return MemberReachable(*conn_a); },
                  absl::Seconds(30))) {
    LOG(ERROR) << "node-b never became reachable from node-a; logs in "
               << dir;
    return {};
  }
  const std::string stream = "xnode";
  std::memset(dst.data(), 0, model.bytes);
  DestinationOptions dopt;
  dopt.instance_id = "xnode-engine";
  dopt.stream = stream;
  auto destination = DestinationClient::Register(
      *conn_b, dopt,
      DestinationLayout::FromPieces(model.spec, model.pieces,
                                    {dst.Describe()}),
      DestinationCallbacks{});
  if (!destination.ok()) {
    LOG(ERROR) << "destination on B: " << destination.status();
    return {};
  }
  SourceOptions so;
  so.stream = stream;
  auto source = SourceClient::Register(
      *conn_a, so, SourceLayout{model.spec, model.pieces, {src.Describe()}});
  if (!source.ok()) {
    LOG(ERROR) << "source on A: " << source.status();
    return {};
  }
  if (!Eventually([&] { return InstanceComplete(*conn_a, stream); },
                  absl::Seconds(30))) {
    LOG(ERROR) << "A never saw B's instance complete; logs in " << dir;
    return {};
  }
  std::vector<double> seconds;
  for (int v = 1; v <= FLAGS_versions; ++v) {
    Change(src, model, v, density);
    const absl::Time start = absl::Now();
    absl::StatusOr<PublishOutcome> outcome = (*source)->PublishVersion(v);
    const absl::Time end = absl::Now();
    if (!outcome.ok()) {
      LOG(ERROR) << "version " << v << ": " << outcome.status()
                 << "; logs in " << dir;
      return {};
    }
    if (!outcome->all_committed()) {
      LOG(ERROR) << "version " << v << ": " << outcome->Summary()
                 << "; logs in " << dir;
      return {};
    }
    if (std::memcmp(dst.data(), src.data(), model.bytes) != 0) {
      LOG(ERROR) << "version " << v << " did not land";
      return {};
    }
    seconds.push_back(absl::ToDoubleSeconds(end - start));
    if (wire != nullptr) wire->push_back(WireBytes(*conn_a, stream, v));
  }
  return seconds;
}

int Main(const char* argv0) {
  const std::string ferryd = FindFerryd(argv0);
  if (ferryd.empty()) {
    LOG(ERROR) << "cannot find daemon/ferryd in runfiles; pass --ferryd";
    return 1;
  }
  std::vector<std::pair<std::string, std::vector<std::string>>> kinds;
  for (absl::string_view kind : absl::StrSplit(FLAGS_channels, ',')) {
    if (kind == "tcp") {
      kinds.push_back({"ferry TcpChannel", {}});
    } else if (absl::ConsumePrefix(&kind, "ucx:")) {
      kinds.push_back({absl::StrCat("ferry UcxChannel, UCX_TLS=", kind),
                       {"--ucx_nodes=*",
                        absl::StrCat("--ucx_transports=", kind)}});
    } else {
      LOG(ERROR) << "--channels: unknown kind \"" << kind << "\"";
      return 2;
    }
  }
  char dir_template[] = "/tmp/ferry-xnode-XXXXXX";
  if (mkdtemp(dir_template) == nullptr) Die("mkdtemp");
  const std::string dir = dir_template;

  const Model model =
      MakeModel(FLAGS_model_mib * kMiB, FLAGS_tensor_mib * kMiB);
  auto src = SharedTensorArena::Create("xnode.src", model.bytes, 0);
  auto dst = SharedTensorArena::Create("xnode.dst", model.bytes, 0);
  if (!src.ok() || !dst.ok()) {
    LOG(ERROR) << "arena: " << src.status() << " " << dst.status();
    return 1;
  }
  std::memset((*src)->data(), 1, model.bytes);

  std::printf("cross_node_bench: %ld cores online; ferryd A (coordinator, "
              "source) and B (member, destination) as processes on "
              "loopback, sharing those cores with this process\n",
              sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("model: %zu bf16 tensors, %.1f MiB, direct pieces, %d "
              "versions A -> B per channel kind\n",
              model.spec.params.size(), model.bytes / double(kMiB),
              FLAGS_versions);

  // Raw loopback stream of the same bytes, --raw_runs times: its median is
  // the yardstick for ferry's median (the same statistic on both sides),
  // its best for ferry's best.
  std::vector<double> raw;
  for (int i = 0; i < FLAGS_raw_runs; ++i) {
    absl::StatusOr<double> s =
        RawLoopbackSeconds((*src)->data(), (*dst)->data(), model.bytes);
    if (!s.ok()) {
      LOG(ERROR) << s.status();
      return 1;
    }
    raw.push_back(*s);
  }
  const double raw_median = Median(raw);
  const double raw_best = *std::min_element(raw.begin(), raw.end());
  std::printf("  raw loopback TCP stream: median %8.2f ms = %6.2f GB/s, best "
              "%8.2f ms = %6.2f GB/s\n",
              raw_median * 1e3, model.bytes / raw_median / 1e9,
              raw_best * 1e3, model.bytes / raw_best / 1e9);
  std::printf("    per run ms:");
  for (double x : raw) std::printf(" %.1f", x * 1e3);
  std::printf("\n");

  int failed = 0;
  for (const auto& [name, flags] : kinds) {
    const std::vector<double> seconds =
        TimeVersions(ferryd, dir, flags, model, **src, **dst);
    if (seconds.empty()) {
      std::printf("  %s: FAILED (see the log above)\n", name.c_str());
      ++failed;
      continue;
    }
    const double t = Median(seconds);
    const double best = *std::min_element(seconds.begin(), seconds.end());
    std::printf("  %s: update (begin..all committed) median %8.2f ms = "
                "%6.2f GB/s, best %8.2f ms = %6.2f GB/s; ratio to raw: "
                "median/median %.2fx, best/best %.2fx (median/best %.2fx)\n",
                name.c_str(), t * 1e3, model.bytes / t / 1e9, best * 1e3,
                model.bytes / best / 1e9, raw_median / t, raw_best / best,
                raw_best / t);
    std::printf("    per version ms:");
    for (double x : seconds) std::printf(" %.1f", x * 1e3);
    std::printf("\n");
  }
  for (absl::string_view d : absl::StrSplit(FLAGS_delta_densities, ',',
                                            absl::SkipEmpty())) {
    double density = 0;
    if (!absl::SimpleAtod(d, &density) || density < 0 || density > 1) {
      LOG(ERROR) << "--delta_densities: \"" << d << "\" is not in [0, 1]";
      return 2;
    }
    std::vector<int64_t> wire;
    std::vector<double> seconds = TimeVersions(
        ferryd, dir,
        {absl::StrCat("--delta_shadow_mb=", 2 * model.bytes / kMiB + 16)},
        model, **src, **dst, density, &wire);
    if (seconds.size() < 2) {
      std::printf("  delta %s: FAILED (see the log above)\n",
                  std::string(d).c_str());
      ++failed;
      continue;
    }
    seconds.erase(seconds.begin());  // version 1: dense, the shadows made
    wire.erase(wire.begin());
    const double t = Median(seconds);
    std::vector<int64_t> sorted = wire;
    std::sort(sorted.begin(), sorted.end());
    const int64_t w = sorted[sorted.size() / 2];
    std::printf("  delta versions, %.1f%% of the elements changed: median "
                "%8.2f ms (%.2f-%.2f), %.1f MiB on the wire (%.1f%% of the "
                "model)\n",
                density * 100, t * 1e3,
                *std::min_element(seconds.begin(), seconds.end()) * 1e3,
                *std::max_element(seconds.begin(), seconds.end()) * 1e3,
                w / double(kMiB), 100.0 * w / model.bytes);
  }
  std::printf("  note: loopback; both daemons, this process and the kernel's "
              "socket copies share the %ld cores. Version 1 also opens the "
              "channel.\n",
              sysconf(_SC_NPROCESSORS_ONLN));
  return failed == 0 ? 0 : 1;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "cross-node update throughput of two ferryd processes on loopback vs "
      "a raw loopback TCP stream");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = 1;
  google::InitGoogleLogging(argv[0]);
  return ferry::Main(argv[0]);
}
