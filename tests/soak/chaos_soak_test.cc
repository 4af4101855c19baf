// Chaos soak (issue 9): a bounded, seeded run of real processes in which
// trainer ranks, engine ranks and member daemons are killed with SIGKILL at
// random points of random versions and restarted, with the invariants
// checked after every version on what users see.
//
// Cluster (all on this machine, each daemon on its own unix socket):
//   soak-a  the coordinator ferryd; trainer rank 0 (in this process, a
//           SourceClient), trainer rank 1 (a soak_trainer_rank process,
//           the one that gets killed) and instance <tag>-a (TP2 demo_engine
//           processes, some parameters through fallback: staging on A);
//   soak-b  a member ferryd with instances <tag>-b (TP2, lm_head through
//           fallback: staging on B) and <tag>-d (below);
//   soak-c  a member ferryd with instance <tag>-c (TP2, every byte direct);
//           instance <tag>-d on soak-b has the same layout: replicas, so d
//           relays from c across C and B (or the other way round).
// The model is examples/demo's Llama scaled to "small" (2 layers, 21
// tensors, 6.25 MiB of bf16; ~3 MiB per engine rank).
//
// Every version v: a seeded RNG picks zero or one fault and a point in
// time (a fraction of a typical version's duration: it may land in any
// phase, or just after the version settled): kill -9 one engine rank, the
// trainer rank 1 process, or member daemon B or C. After the version
// settles, whatever was killed is started again (an engine rank or the
// trainer rank with --replace_existing; a daemon on the same socket, whose
// engines register again through it on their own), and the soak waits,
// with a deadline, until the stream is complete again. Then it checks:
//
//   bytes      every instance that reports COMMITTED at v holds exactly v's
//              bytes: the soak maps each rank's live arena (/dev/shm)
//              itself and compares every live byte with weight_pattern.h
//              (independent of ferry's plans); the engine processes check
//              the same on their own and must log "COMMIT v: OK", never
//              "MISMATCH". A clean abort must not have written anything:
//              every rank still holds what it held before.
//   commits    every instance the fault did not hit commits v; an instance
//              it hit ends ABORTED (or COMMITTED if the fault came after its
//              commit, or absent if it was incomplete when v began) and
//              commits again within kRecoveryVersions versions that began
//              after the restart.
//   listed     between versions, after the restarts: an instance that
//              ListStreams lists clean at committed_version c > 0 holds c
//              on every rank.
//   bootstrap  a restarted rank's instance may be filled from a peer
//              instance between versions (docs/api.md, "Bootstrap and
//              reload"): its ranks then log "COMMIT vL: OK" for a version
//              the soak did not see it commit. From then on the soak
//              expects L's bytes in it, and checks them (every byte, as
//              above) when it is listed, and after a clean abort.
//   processes  nothing exits that was not killed; at the end every process
//              exits cleanly on SIGTERM/EOF and leaves no /dev/shm entry.
//   resources  each ferryd's private RSS (VmRSS - RssShmem), /dev/shm
//              mappings and open fds, and the soak's /dev/shm entries,
//              sampled after every version; the sample after warm-up (per
//              daemon generation: a restarted daemon against its own) vs
//              the last one (slack below).
//
// Faults start after kWarmup versions and stop kCooldown versions before
// the end (so the end state is steady). A summary table is printed at the
// end. Knobs: --soak_versions=N or FERRY_SOAK_VERSIONS (default 100),
// FERRY_SOAK_SEED (default: random, printed), e.g.
//   bazel test //tests/soak:chaos_soak_test --test_env=FERRY_SOAK_SEED=7
//       --test_arg=--soak_versions=500
// Bugs it found (each fixed in its own commit, with a regression test):
//   seed 1  a rank kept mapping the dead daemon's staging after its daemon
//           restarted (same region ids): every fallback tensor failed APPLY
//           and the instance never committed again (DestinationClient);
//   seed 1  a restarted rank (held_version 0) could not register while its
//           peers held a later version (Registry: INVALID_ARGUMENT);
//   seed 3  ListStreams went on listing an instance COMMITTED at v after
//           one of its ranks came back with the base weights;
//   seed 4  a replica relaying from an instance on a member that was killed
//           mid-copy was aborted instead of being fed from the trainer.
// Children get SIGKILL when this process dies (PR_SET_PDEATHSIG); every
// /dev/shm entry with the soak's tag is removed at the end, also on failure
// and on SIGTERM (Bazel's timeout).
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/weight_pattern.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/layout_resolution.h"
#include "core/models/engine_layout.h"
#include "core/models/trainer_layout.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/version.pb.h"
#include "tests/client/process_harness.h"
#include "tests/daemon/test_certs.h"

namespace ferry {
namespace {

using testing::Runfile;

// ---------------------------------------------------------------------------
// Knobs

constexpr int kWarmup = 10;    // versions before faults and the baseline
constexpr int kCooldown = 5;   // fault-free versions at the end
// The schedule `bazel test //...` runs (seeds 41 and 51-53 were also run
// green at 100 versions, and 31 at 400, when the soak was tagged manual).
constexpr uint64_t kDefaultSeed = 51;
// A restarted daemon's baseline: this many versions after its restart.
constexpr int kRestartWarmup = 5;
// A daemon generation is judged only if it lived this many versions past
// its baseline.
constexpr int kMinJudgedVersions = 10;
// A hit instance commits again within this many versions begun after the
// restart ("a couple"; the soak waits until every rank registered again
// before the next version, and so far every recovery took one).
constexpr int kRecoveryVersions = 2;
// Faults per version after warm-up: P(none) = 0.55, engine rank 0.22,
// trainer rank 0.12, member daemon 0.11.
constexpr double kPNone = 0.55, kPEngine = 0.22, kPTrainer = 0.12;
// The kill lands at U(0, kWhenSpan) times a typical version's duration.
constexpr double kWhenSpan = 1.3;
// Resource slack, the last sample vs the one after warm-up of the same
// daemon generation. ferryd maps its clients' shared memory, so VmRSS is
// judged in two parts:
//  - private (VmRSS - RssShmem: heap, stacks, code) +20%, at least
//    +12 MiB, with ferryd run with MALLOC_MMAP_THRESHOLD_=1 MiB. With
//    glibc's default (dynamic) threshold the coordinator's steps up ~9 MiB
//    at a time as threads join the gRPC pool (twice in 400 versions:
//    44 -> 52..67 MiB): TcpChannel::Send allocates each bucket's buffer
//    anew (heaptrack over 200 versions: peak heap 18.8 MiB, 15.2 of it
//    those buffers; 0.3 MiB not freed at exit) and glibc keeps big freed
//    blocks in each thread's arena. With the fixed threshold: 45 -> 51 MiB
//    over 300 versions and 120 faults. A leak of 120 KiB per version, of
//    one model copy (6 MiB) every 50 versions or of 300 KiB per restart
//    exceeds it within 100 versions.
//    Member daemons: at least +20 MiB. Since peer deliveries (issue 11) a
//    member whose instance serves as the peer of a bootstrap sends (Peer
//    RunTransfer "send"): it opens a TCP channel to each node it fills,
//    and each channel keeps two staging buffers of up to one bucket for
//    later sends (TcpChannel; the soak's buckets are a few MiB). That is a
//    step of 9-13 MiB the first time, seen with seeds 7 and 51 (soak-c,
//    the peer of most bootstraps: 35 -> 46..49 MiB, then flat), not a
//    growth. A leak of 200 KiB per version still exceeds it within 100.
//  - shm mappings (distinct /dev/shm files in /proc/<pid>/maps) +24: a
//    settled version keeps its plan and so its participants' memory mapped
//    while it is in the history (16 versions), so killed clients' arenas
//    stay mapped for a while; with a fault every ~2 versions that is at
//    most ~8 retired participants of up to 3 mappings. A participant never
//    unmapped adds one per restart, ~40 in 100 versions.
//  - open fds +16: a restart leaves gRPC subchannels closing for a while;
//    a leak of one fd per restart or per version exceeds it.
//  - /dev/shm entries +8 (the soak's own, all processes): the steady
//    state is 2 trainer + 8 engine arenas + staging; a leaked staging set
//    per restart exceeds it within a few restarts.
constexpr double kPrivateGrowth = 0.20;
constexpr int64_t kPrivateFloorKb = 12 << 10;
constexpr int64_t kMemberPrivateFloorKb = 20 << 10;
constexpr int kMapSlack = 24;
constexpr int kFdSlack = 16;
constexpr int kShmSlack = 8;

constexpr absl::Duration kReadyDeadline = absl::Seconds(30);
constexpr absl::Duration kVersionDeadline = absl::Seconds(60);
constexpr absl::Duration kEngineLogDeadline = absl::Seconds(10);
constexpr int kMaxViolations = 25;  // stop early past this many

struct SoakConfig {
  int versions = 100;
  uint64_t seed = 0;
  std::string scale = "small";
};
SoakConfig g_config;

// ---------------------------------------------------------------------------
// Everything the soak made, removable from a signal handler too.

// In every /dev/shm name the soak's processes create (instance ids and
// arena hints carry it), so that the soak counts and removes only its own
// entries, never those of tests running beside it.
char g_tag[32] = "";

// The soak's /dev/shm entries ("ferry-...<tag>...-<pid>-<nonce>-<n>").
std::vector<std::string> TaggedShm() {
  std::vector<std::string> names;
  DIR* dir = opendir("/dev/shm");
  if (dir == nullptr) return names;
  while (dirent* e = readdir(dir)) {
    if (g_tag[0] != '\0' && std::strstr(e->d_name, g_tag) != nullptr) {
      names.push_back(e->d_name);
    }
  }
  closedir(dir);
  return names;
}

// The creator's pid of a SharedMemoryRegion name: "...-<pid>-<nonce>-<n>".
pid_t CreatorOf(const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, '-');
  int pid = 0;
  if (parts.size() < 4 || !absl::SimpleAtoi(parts[parts.size() - 3], &pid)) {
    return 0;
  }
  return pid;
}

// Removes the soak's entries created by `pid` (0: all); returns how many.
int UnlinkShmOf(pid_t pid) {
  int n = 0;
  for (const std::string& name : TaggedShm()) {
    if (pid != 0 && CreatorOf(name) != pid) continue;
    n += unlink(("/dev/shm/" + name).c_str()) == 0;
  }
  return n;
}

// SIGTERM/SIGINT (Bazel's timeout): kill the children, remove the soak's
// /dev/shm entries, then die of the signal. Catch2 reports the signal first
// and re-raises it to this handler. opendir is not async-signal-safe; the
// process is about to die anyway.
void OnFatalSignal(int sig) {
  testing::KillAllChildProcesses();
  UnlinkShmOf(0);
  signal(sig, SIG_DFL);
  raise(sig);
}

// ---------------------------------------------------------------------------
// Child processes

// A child (tests/support/child_process.h): stderr (and stdout, unless
// piped) in `log`; with `piped`, its stdin and stdout are pipes to this
// process. SIGKILLed when this process dies (PR_SET_PDEATHSIG: spawn only
// from the main thread, since the signal follows the spawning thread), on
// destruction, and by OnFatalSignal. Between fork and exec only
// async-signal-safe calls.
using Child = testing::ChildProcess;

// `env`: added to this process's environment for the child.
std::unique_ptr<Child> StartChild(const std::string& binary,
                                  std::vector<std::string> args,
                                  const std::string& log, bool piped,
                                  std::vector<std::string> env = {}) {
  testing::ChildOptions options;
  options.log = log;
  options.piped = piped;
  options.env = std::move(env);
  return testing::StartProcess(binary, std::move(args), std::move(options));
}

// Follows a log file: the lines added since the last call.
class LogTail {
 public:
  explicit LogTail(std::string path) : path_(std::move(path)) {}
  std::vector<std::string> NewLines() {
    std::vector<std::string> lines;
    std::ifstream in(path_, std::ios::binary);
    if (!in) return lines;
    in.seekg(static_cast<std::streamoff>(offset_));
    std::string line;
    while (std::getline(in, line)) {
      if (in.eof()) break;  // a partial line: read it again next time
      offset_ += line.size() + 1;
      lines.push_back(line);
    }
    return lines;
  }

 private:
  std::string path_;
  size_t offset_ = 0;
};

// ---------------------------------------------------------------------------
// Resources of one process

struct ResourceSample {
  int64_t rss_kb = 0;     // VmRSS
  int64_t shmem_kb = 0;   // RssShmem: mapped client memory and staging
  int fds = 0;
  int threads = 0;
  int shm_maps = 0;       // distinct /dev/shm files mapped
  int64_t private_kb() const { return rss_kb - shmem_kb; }
};

ResourceSample SampleOf(pid_t pid) {
  ResourceSample s;
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string key;
  while (status >> key) {
    if (key == "VmRSS:") status >> s.rss_kb;
    if (key == "RssShmem:") status >> s.shmem_kb;
    if (key == "Threads:") status >> s.threads;
    status.ignore(1 << 10, '\n');
  }
  if (DIR* dir = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    while (dirent* e = readdir(dir)) s.fds += e->d_name[0] != '.';
    closedir(dir);
  }
  std::ifstream maps(absl::StrCat("/proc/", pid, "/maps"));
  std::set<std::string> files;
  std::string line;
  while (std::getline(maps, line)) {
    const size_t at = line.find("/dev/shm/");
    if (at != std::string::npos) files.insert(line.substr(at));
  }
  s.shm_maps = static_cast<int>(files.size());
  return s;
}

// ---------------------------------------------------------------------------
// The cluster's parts

struct Daemon {
  std::string node;
  bool coordinator = false;
  std::string socket;
  int generation = -1;
  std::unique_ptr<Child> process;
  int port = 0;
  int64_t started_unix_ms = 0;  // of the current generation
  std::unique_ptr<Connection> connection;  // its unix socket
  std::string address() const { return absl::StrCat("127.0.0.1:", port); }
};

struct EngineRank {
  int tp_rank = 0;
  std::unique_ptr<Child> process;
  std::unique_ptr<LogTail> tail;
  int64_t last_ok_commit = 0;  // from its log: "COMMIT v<N>: OK"
  int mismatch_lines = 0;      // from its log: "MISMATCH"
  // The version whose bytes its live arena holds, as far as the soak knows:
  // 0 after a (re)start (base weights), v after its instance committed v,
  // unchanged by a clean abort, -1 (unknown) after a dirty one.
  int64_t held = 0;
  int starts = 0;
  int64_t started_unix_ms = 0;  // of the current process
};

struct Instance {
  std::string id;
  Daemon* daemon = nullptr;  // its node
  std::string fallback;      // demo_engine --fallback
  std::vector<EngineRank> ranks;
  // Recovery after a fault that hit it: set at the kill, cleared by the
  // first commit of a version begun after the restart.
  bool recovering = false;
  absl::Time hit_at;
  int64_t restarted_before = 0;  // the first version begun after the restart
  // Counters for the summary.
  int commits = 0, aborts = 0, absent = 0, hits = 0;
  int relayed = 0;  // versions whose bytes it took from a replica
  absl::Duration max_recovery;
  int max_recovery_versions = 0;
};

enum class FaultKind { kNone, kEngine, kTrainer, kMember };

struct Fault {
  FaultKind kind = FaultKind::kNone;
  int target = 0;     // engine: instance * 2 + tp rank; member: 0 = B, 1 = C
  double when = 0;    // fraction of a typical version's duration
};

// One daemon generation's resources.
struct Generation {
  std::string node;
  int generation = 0;
  pid_t pid = 0;
  int64_t started = 0;  // the first version it served
  std::optional<ResourceSample> base;
  int64_t base_version = 0;
  ResourceSample last;
  int64_t last_version = 0;
  // The largest of each over every sample.
  int64_t max_private_kb = 0, max_rss_kb = 0;
  int max_fds = 0, max_maps = 0;
};

// Live pieces of one engine TP rank: what the soak checks in its arena.
struct RankCheck {
  std::vector<Piece> pieces;
  int64_t arena_bytes = 0;
};

// ---------------------------------------------------------------------------
// The soak

class ChaosSoak {
 public:
  ChaosSoak() {
    char dir[] = "/tmp/ferry-soak-XXXXXX";
    REQUIRE(mkdtemp(dir) != nullptr);
    dir_ = dir;
    std::random_device rd;
    absl::SNPrintF(g_tag, sizeof(g_tag), "sk%08x", rd());
    tag_ = g_tag;
    rng_.seed(g_config.seed);
    auto schema = LoadDemoModel("llama-3.1-8b", g_config.scale);
    REQUIRE(schema.ok());
    schema_ = *std::move(schema);
    BuildChecks();
  }

  ~ChaosSoak() {
    // Children first (their destructors SIGKILL), then their shm.
    source_.reset();
    trainer_arena_.reset();
    trainer1_.reset();
    for (Instance& inst : instances_) {
      for (EngineRank& r : inst.ranks) r.process.reset();
    }
    for (Daemon* d : {&a_, &b_, &c_}) d->process.reset();
    const int left = UnlinkShmOf(0);
    if (left > 0) std::printf("removed %d leftover /dev/shm entries\n", left);
    if (passed_) {
      std::error_code ignored;
      std::filesystem::remove_all(dir_, ignored);
    } else {
      std::printf("logs kept in %s\n", dir_.c_str());
    }
  }

  void Run() {
    std::printf("chaos soak: FERRY_SOAK_SEED=%llu versions=%d model=%s "
                "tag=%s logs=%s\n",
                static_cast<unsigned long long>(g_config.seed),
                g_config.versions, g_config.scale.c_str(), tag_.c_str(),
                dir_.c_str());
    std::fflush(stdout);
    const absl::Time start = absl::Now();
    StartCluster();
    for (int64_t v = 1; v <= g_config.versions; ++v) {
      const Fault fault = PickFault(v);
      RunVersion(v, fault);
      SampleResources(v);
      if (static_cast<int>(violations_.size()) >= kMaxViolations) {
        Violation(v, "too many violations; stopping the soak early");
        break;
      }
    }
    CheckResources();
    Shutdown();
    PrintSummary(absl::Now() - start);
    INFO("seed " << g_config.seed << ", logs in " << dir_);
    INFO(absl::StrJoin(violations_, "\n"));
    CHECK(violations_.empty());
    passed_ = violations_.empty();
  }

 private:
  // -- setup ---------------------------------------------------------------

  void BuildChecks() {
    EngineParallelism par;
    par.tp = 2;
    auto tables = BuildEngineTables(schema_.spec, schema_.config, par);
    REQUIRE(tables.ok());
    auto resolved = ResolveDestinationLayout(schema_.spec, *tables);
    REQUIRE(resolved.ok());
    for (int r = 0; r < 2; ++r) {
      RankCheck check;
      check.arena_bytes = (*tables)[r].buffer_bytes[0];
      for (const Piece& p : resolved->ranks[r].layout.pieces) {
        if (!(p.buffer & kStagingBufferBit)) check.pieces.push_back(p);
      }
      REQUIRE_FALSE(check.pieces.empty());
      checks_.push_back(std::move(check));
    }
  }

  std::vector<std::string> DaemonFlags(const Daemon& d) const {
    std::vector<std::string> args = {
        "--node=" + d.node, "--socket=" + d.socket, "--listen=127.0.0.1:0",
        "--port_file=" + PortFile(d),
        // A killed process is noticed within a second or two: pid watches
        // every 100 ms, leases of 2 s (heartbeats every 2/3 s), a member
        // lease of 1.5 s; acks get 3 s, a whole version 10 s (generous for
        // a loaded 2-core machine; a version takes ~0.1 s here).
        "--peer_lease_ms=1500", "--lease_ms=2000", "--ack_timeout_ms=3000",
        "--version_timeout_ms=10000", "--relay_wait_ms=500",
        "--drain_timeout_ms=2000", "--copy_threads=2", "--logtostderr"};
    for (const std::string& f : testing::TlsFlags(d.node)) args.push_back(f);
    if (!d.coordinator) args.push_back("--coordinator=" + a_.address());
    return args;
  }
  std::string PortFile(const Daemon& d) const {
    return absl::StrCat(dir_, "/", d.node, ".port");
  }

  void StartDaemon(Daemon& d, int64_t version) {
    unlink(PortFile(d).c_str());
    ++d.generation;
    d.started_unix_ms = absl::ToUnixMillis(absl::Now());
    // A fixed mmap threshold, so that RSS follows ferryd's live heap (see
    // kPrivateGrowth): glibc's dynamic one parks the freed per-bucket send
    // buffers in each thread's malloc arena, in steps of ~9 MiB.
    d.process = StartChild(
        Runfile("daemon/ferryd"), DaemonFlags(d),
        absl::StrCat(dir_, "/", d.node, ".", d.generation, ".log"), false,
        {"MALLOC_MMAP_THRESHOLD_=1048576"});
    d.port = 0;
    const bool up = testing::Eventually(
        [&] {
          std::ifstream in(PortFile(d));
          return static_cast<bool>(in >> d.port) && d.port > 0;
        },
        kReadyDeadline);
    INFO(d.node << " did not write its port; log " << d.process->log());
    REQUIRE(up);
    if (d.connection == nullptr) {
      ConnectionOptions o;
      o.address = "unix:" + d.socket;
      o.rpc_timeout = absl::Seconds(15);
      auto conn = Connection::Open(o);
      REQUIRE(conn.ok());
      d.connection = std::make_unique<Connection>(*std::move(conn));
    }
    Generation g;
    g.node = d.node;
    g.generation = d.generation;
    g.pid = d.process->pid();
    g.started = version;
    generations_.push_back(g);
  }

  void StartEngine(Instance& inst, EngineRank& r) {
    std::vector<std::string> args = {
        "--daemon=unix:" + inst.daemon->socket, "--instance=" + inst.id,
        "--tp=2", absl::StrCat("--tp_rank=", r.tp_rank),
        "--scale=" + g_config.scale, "--exit_after_version=0",
        "--timeout_s=36000", "--logtostderr"};
    if (!inst.fallback.empty()) args.push_back("--fallback=" + inst.fallback);
    if (r.starts > 0) args.push_back("--replace_existing");
    const std::string log =
        absl::StrCat(dir_, "/", inst.id, ".tp", r.tp_rank, ".", r.starts, ".log");
    r.process = StartChild(Runfile("examples/demo/demo_engine"), args, log, false);
    r.tail = std::make_unique<LogTail>(log);
    r.held = 0;
    r.last_ok_commit = 0;
    r.started_unix_ms = absl::ToUnixMillis(absl::Now());
    ++r.starts;
  }

  void StartTrainerRank1(bool replace) {
    std::vector<std::string> args = {
        "--daemon=unix:" + a_.socket, "--tp=2", "--rank=1",
        "--scale=" + g_config.scale, "--arena_hint=" + tag_ + ".trainer.r1",
        "--logtostderr"};
    if (replace) args.push_back("--replace_existing");
    trainer1_started_unix_ms_ = absl::ToUnixMillis(absl::Now());
    trainer1_ = StartChild(
        Runfile("tests/soak/soak_trainer_rank"), args,
        absl::StrCat(dir_, "/trainer.r1.", trainer1_starts_++, ".log"), true);
    std::optional<std::string> ready = trainer1_->ReadLine(kReadyDeadline);
    INFO("trainer rank 1 log " << trainer1_->log());
    REQUIRE(ready.has_value());
    REQUIRE(absl::StartsWith(*ready, "ready "));
  }

  void StartCluster() {
    a_.node = "soak-a";
    a_.coordinator = true;
    b_.node = "soak-b";
    c_.node = "soak-c";
    for (Daemon* d : {&a_, &b_, &c_}) {
      d->socket = absl::StrCat(dir_, "/", d->node, ".sock");
    }
    StartDaemon(a_, 1);
    StartDaemon(b_, 1);
    StartDaemon(c_, 1);
    conn_ = a_.connection.get();
    REQUIRE(conn_->WaitForReady(kReadyDeadline).ok());
    REQUIRE(testing::Eventually([&] { return MembersReachable(); },
                                kReadyDeadline));

    // a and b take some parameters through fallback (staging on A, on B);
    // c and d are plain replicas on C and B, so one relays from the other
    // (instances with staging on a member are fed from the sources).
    const struct {
      const char* suffix;
      Daemon* daemon;
      const char* fallback;
    } placement[] = {{"-a", &a_, "lm_head,layers.0.mlp"},
                     {"-b", &b_, "lm_head"},
                     {"-c", &c_, ""},
                     {"-d", &b_, ""}};
    instances_.resize(4);
    for (size_t i = 0; i < instances_.size(); ++i) {
      instances_[i].id = tag_ + placement[i].suffix;
      instances_[i].daemon = placement[i].daemon;
      instances_[i].fallback = placement[i].fallback;
    }
    for (Instance& inst : instances_) {
      inst.ranks.resize(2);
      for (int r = 0; r < 2; ++r) {
        inst.ranks[r].tp_rank = r;
        StartEngine(inst, inst.ranks[r]);
      }
    }

    // Trainer rank 0 in this process, rank 1 in its own.
    TrainerParallelism par;
    par.tp = 2;
    auto layouts = BuildTrainerLayout(schema_.spec, schema_.config, par);
    REQUIRE(layouts.ok());
    trainer_layout_ = (*layouts)[0];
    auto arena = SharedTensorArena::Create(tag_ + ".trainer.r0",
                                           trainer_layout_.buffer_bytes[0], 0);
    REQUIRE(arena.ok());
    trainer_arena_ = *std::move(arena);
    REQUIRE(trainer_arena_->Allocate(trainer_layout_.buffer_bytes[0]).ok());
    SourceOptions so;
    so.stream = "policy";
    so.rank = 0;
    so.world_size = 2;
    so.commit_timeout = kVersionDeadline;
    auto source = SourceClient::Register(
        *conn_, so,
        SourceLayout{schema_.spec, trainer_layout_.pieces,
                     {trainer_arena_->Describe()}});
    INFO(source.status().ToString());
    REQUIRE(source.ok());
    source_ = *std::move(source);
    StartTrainerRank1(false);

    std::string why;
    const bool ready = testing::Eventually(
        [&] { return StreamReady(&why); }, kReadyDeadline);
    INFO(why << "; logs in " << dir_);
    REQUIRE(ready);
  }

  // -- cluster queries -----------------------------------------------------

  bool MembersReachable() const {
    v1::GetHealthResponse h;
    auto context = conn_->NewContext(absl::Seconds(2));
    if (!conn_->inspection().GetHealth(context.get(), {}, &h).ok()) return false;
    int reachable = 0;
    for (const v1::PeerHealth& p : h.peers()) reachable += p.reachable();
    return reachable == 2;
  }

  std::optional<v1::StreamInfo> Stream() const {
    v1::ListStreamsRequest request;
    request.set_stream("policy");
    v1::ListStreamsResponse response;
    auto context = conn_->NewContext(absl::Seconds(5));
    if (!conn_->inspection().ListStreams(context.get(), request, &response)
             .ok() ||
        response.streams_size() != 1) {
      return std::nullopt;
    }
    return response.streams(0);
  }

  // Ready for the next version: both members joined; both source ranks and
  // every engine rank registered by the processes running now (pids), each
  // engine rank subscribed and, on a restarted member, registered after the
  // restart (through the new daemon: the old registrations linger at the
  // coordinator until the new daemon's join removes them); no version in
  // progress. `why` says what is missing.
  bool StreamReady(std::string* why) const {
    if (!MembersReachable()) {
      *why = "a member daemon is not reachable from the coordinator";
      return false;
    }
    for (const Daemon* d : {&b_, &c_}) {
      v1::GetHealthResponse h;
      auto context = d->connection->NewContext(absl::Seconds(2));
      if (!d->connection->inspection().GetHealth(context.get(), {}, &h).ok() ||
          h.peers_size() != 1 || !h.peers(0).reachable()) {
        *why = absl::StrCat(d->node, " has not joined the coordinator");
        return false;
      }
    }
    v1::ListParticipantsRequest request;
    request.set_stream("policy");
    v1::ListParticipantsResponse response;
    auto context = conn_->NewContext(absl::Seconds(5));
    if (!conn_->inspection().ListParticipants(context.get(), request, &response)
             .ok()) {
      *why = "ListParticipants failed";
      return false;
    }
    std::map<std::string, const v1::ParticipantInfo*> by_rank;
    for (const v1::ParticipantInfo& p : response.participants()) {
      const std::string key =
          p.has_source() ? absl::StrCat("source.", p.source().rank())
                         : absl::StrCat(p.destination().instance_id(), ".tp",
                                        p.destination().tp_rank());
      by_rank[key] = &p;
    }
    std::vector<std::string> missing;
    auto expect = [&](const std::string& key, pid_t pid, int64_t since_ms,
                      bool destination) {
      auto it = by_rank.find(key);
      if (it == by_rank.end()) {
        missing.push_back(absl::StrCat(key, " not registered"));
      } else if (it->second->pid() != 0 && it->second->pid() != pid) {
        missing.push_back(absl::StrCat(key, " registered by pid ",
                                       it->second->pid(), ", not ", pid));
      } else if (it->second->registered_unix_ms() < since_ms) {
        missing.push_back(absl::StrCat(key, " not registered again"));
      } else if (destination && !it->second->destination().subscribed()) {
        missing.push_back(absl::StrCat(key, " not subscribed"));
      }
    };
    expect("source.0", getpid(), 0, false);
    expect("source.1", trainer1_->pid(), trainer1_started_unix_ms_, false);
    for (const Instance& inst : instances_) {
      for (const EngineRank& r : inst.ranks) {
        expect(absl::StrCat(inst.id, ".tp", r.tp_rank), r.process->pid(),
               std::max(r.started_unix_ms, inst.daemon->started_unix_ms),
               true);
      }
    }
    std::optional<v1::StreamInfo> info = Stream();
    if (!info) {
      missing.push_back("ListStreams failed");
    } else if (info->version_in_progress() != 0) {
      missing.push_back(absl::StrCat("version ", info->version_in_progress(),
                                     " in progress"));
    }
    *why = absl::StrJoin(missing, "; ");
    return missing.empty();
  }

  // Every instance's status for v (empty when v never began).
  std::vector<v1::InstanceStatus> WaitForVersion(int64_t v) const {
    v1::WaitForVersionRequest request;
    request.set_stream("policy");
    request.set_version(v);
    request.set_timeout_ms(5000);
    v1::WaitForVersionResponse response;
    auto context = conn_->NewContext(absl::Seconds(10));
    if (!conn_->versions().WaitForVersion(context.get(), request, &response)
             .ok()) {
      return {};
    }
    return {response.instances().begin(), response.instances().end()};
  }

  // -- faults --------------------------------------------------------------

  Fault PickFault(int64_t v) {
    // Always three draws, so the schedule depends on the seed alone.
    std::uniform_real_distribution<double> u(0.0, 1.0);
    const double kind = u(rng_), target = u(rng_), when = u(rng_);
    Fault f;
    if (v <= kWarmup || v > g_config.versions - kCooldown) return f;
    if (kind < kPNone) return f;
    f.when = when * kWhenSpan;
    if (kind < kPNone + kPEngine) {
      f.kind = FaultKind::kEngine;
      const int ranks = static_cast<int>(2 * instances_.size());
      f.target = std::min(ranks - 1, static_cast<int>(target * ranks));
    } else if (kind < kPNone + kPEngine + kPTrainer) {
      f.kind = FaultKind::kTrainer;
    } else {
      f.kind = FaultKind::kMember;
      f.target = target < 0.5 ? 0 : 1;
    }
    return f;
  }

  std::string Describe(const Fault& f) const {
    switch (f.kind) {
      case FaultKind::kNone: return "-";
      case FaultKind::kEngine:
        return absl::StrFormat("kill engine %s.tp%d @%.2f",
                               instances_[f.target / 2].id, f.target % 2, f.when);
      case FaultKind::kTrainer:
        return absl::StrFormat("kill trainer rank 1 @%.2f", f.when);
      case FaultKind::kMember:
        return absl::StrFormat("kill daemon %s @%.2f",
                               f.target == 0 ? b_.node : c_.node, f.when);
    }
    return "?";
  }

  bool Hits(const Fault& f, const Instance& inst) const {
    switch (f.kind) {
      case FaultKind::kNone: return false;
      case FaultKind::kEngine: return &instances_[f.target / 2] == &inst;
      case FaultKind::kTrainer: return true;  // the whole version aborts
      case FaultKind::kMember:
        return inst.daemon == (f.target == 0 ? &b_ : &c_);
    }
    return false;
  }

  Child* Victim(const Fault& f) {
    switch (f.kind) {
      case FaultKind::kNone: return nullptr;
      case FaultKind::kEngine:
        return instances_[f.target / 2].ranks[f.target % 2].process.get();
      case FaultKind::kTrainer: return trainer1_.get();
      case FaultKind::kMember:
        return (f.target == 0 ? b_ : c_).process.get();
    }
    return nullptr;
  }

  // -- one version ---------------------------------------------------------

  void RunVersion(int64_t v, const Fault& fault) {
    const absl::Time start = absl::Now();
    // Trainer rank 1 (its process) and rank 0 (here) publish together.
    const bool sent = trainer1_->WriteLine(absl::StrCat(v));
    std::future<absl::StatusOr<PublishOutcome>> rank0 =
        std::async(std::launch::async, [this, v] {
          for (const Piece& p : trainer_layout_.pieces) {
            FillPiece(v, schema_.spec.params[p.param], p, trainer_arena_->data());
          }
          return source_->PublishVersion(v);
        });
    absl::Time killed_at = absl::InfiniteFuture();
    if (fault.kind != FaultKind::kNone) {
      // The kill may land after the version settled: between versions.
      absl::SleepFor(start + typical_ * fault.when - absl::Now());
      // Reaped at once, as a supervisor would: the daemons' pid watches
      // (kill(pid, 0)) see a zombie as alive until its lease runs out.
      Victim(fault)->Kill9();
      killed_at = absl::Now();
      ++faults_[static_cast<int>(fault.kind)];
    }
    // Every wait below is bounded: CommitVersion by the daemon's version
    // timeout (and the client's commit timeout), rank 1 by kVersionDeadline.
    absl::StatusOr<PublishOutcome> outcome = rank0.get();
    std::optional<std::string> reply;
    if (sent) reply = trainer1_->ReadLine(kVersionDeadline);
    const absl::Duration took = absl::Now() - start;
    if (v >= 2 && v <= kWarmup) warmup_durations_.push_back(took);
    if (v == kWarmup) {
      std::sort(warmup_durations_.begin(), warmup_durations_.end());
      typical_ = warmup_durations_[warmup_durations_.size() / 2];
      std::printf("typical version: %s (median of versions 2-%d)\n",
                  absl::FormatDuration(typical_).c_str(), kWarmup);
    }
    max_version_time_ = std::max(max_version_time_, took);
    if (fault.kind != FaultKind::kTrainer &&
        (!reply.has_value() || !absl::StartsWith(*reply, absl::StrCat("v ", v, " ")))) {
      Violation(v, absl::StrCat("trainer rank 1 answered '", reply.value_or("<none>"),
                                "'; log ", trainer1_->log()));
    }

    std::map<std::string, v1::InstanceStatus> statuses;
    std::string result;
    if (outcome.ok()) {
      for (const v1::InstanceStatus& s : outcome->instances) {
        statuses[s.instance_id()] = s;
      }
      result = outcome->Summary();
    } else {
      // A whole-version abort returns no statuses: ask as anyone else would.
      result = outcome.status().ToString();
      for (const v1::InstanceStatus& s : WaitForVersion(v)) {
        statuses[s.instance_id()] = s;
      }
      if (fault.kind != FaultKind::kTrainer) {
        Violation(v, absl::StrCat("rank 0's PublishVersion failed without a "
                                  "trainer fault: ", result));
      }
      ++whole_version_aborts_;
    }
    std::printf("v%-4lld %-6s %-40s %s\n", static_cast<long long>(v),
                absl::FormatDuration(absl::Trunc(took, absl::Milliseconds(1)))
                    .c_str(),
                Describe(fault).c_str(), result.c_str());
    std::fflush(stdout);

    CheckInstances(v, fault, statuses, killed_at, !outcome.ok());
    CountRelays(v);
    Restart(v, fault);
    CheckUnexpectedExits(v);
    CheckListedStatuses(v);
  }

  void CountRelays(int64_t v) {
    v1::GetProgressRequest request;
    request.set_stream("policy");
    request.set_version(v);
    v1::GetProgressResponse response;
    auto context = conn_->NewContext(absl::Seconds(5));
    if (!conn_->inspection().GetProgress(context.get(), request, &response)
             .ok()) {
      return;
    }
    for (const v1::InstanceProgress& p : response.instances()) {
      if (p.relayed_from().empty()) continue;
      for (Instance& inst : instances_) {
        inst.relayed += inst.id == p.status().instance_id();
      }
    }
  }

  // What ListStreams (ferryctl streams) says between versions, after the
  // restarts: an instance listed clean at committed_version c > 0 (a version
  // the trainer published) holds c on every rank. (0 claims nothing the
  // trainer published: the base weights, or ranks that hold different
  // versions after a restart, which then count as the lowest.)
  void CheckListedStatuses(int64_t v) {
    std::optional<v1::StreamInfo> info = Stream();
    if (!info) {
      Violation(v, "ListStreams failed");
      return;
    }
    // Bootstraps run between versions, right after a restart: wait until
    // every complete instance behind the latest version was filled, or is
    // told to wait (no peer), or its bootstrap aborted; so that none runs
    // when the next version begins unseen by the soak.
    const bool settled = testing::Eventually(
        [&] {
          std::optional<v1::StreamInfo> now = Stream();
          if (!now) return false;
          if (now->has_delivery() && !now->delivery().settled()) return false;
          for (const v1::InstanceInfo& i : now->instances()) {
            const v1::InstanceStatus& st = i.status();
            if (i.registered_tp_ranks_size() < i.tp_size()) continue;
            if (st.committed_version() < now->latest_committed_version() &&
                st.state() == v1::INSTANCE_STATE_IDLE &&
                st.waiting_reason().empty()) {
              return false;
            }
          }
          info = std::move(now);
          return true;
        },
        absl::Seconds(10));
    if (!settled) {
      Violation(v, "an instance behind the latest version was neither "
                   "bootstrapped nor told why it waits within 10 s");
    }
    // A bootstrap that committed just now: its ranks' COMMIT lines may
    // still be on their way into the logs.
    auto behind = [&] {
      for (const v1::InstanceInfo& listed : info->instances()) {
        const v1::InstanceStatus& s = listed.status();
        if (s.dirty() || s.committed_version() == 0) continue;
        for (Instance& inst : instances_) {
          if (inst.id != listed.instance_id()) continue;
          for (EngineRank& r : inst.ranks) {
            if (r.held >= 0 && r.held < s.committed_version()) return true;
          }
        }
      }
      return false;
    };
    testing::Eventually(
        [&] {
          LearnBootstraps(v);
          return !behind();
        },
        absl::Seconds(5));
    for (const v1::InstanceInfo& listed : info->instances()) {
      const v1::InstanceStatus& s = listed.status();
      if (s.dirty() || s.committed_version() == 0) continue;
      for (Instance& inst : instances_) {
        if (inst.id != listed.instance_id()) continue;
        for (EngineRank& r : inst.ranks) {
          if (r.held != s.committed_version()) {
            Violation(v, absl::StrCat(
                             inst.id, " is listed ",
                             v1::InstanceState_Name(s.state()), " at v",
                             s.version(), " with committed_version ",
                             s.committed_version(), " but tp rank ", r.tp_rank,
                             " holds version ", r.held,
                             r.held == 0 ? " (restarted: base weights)" : ""));
          }
        }
      }
    }
  }

  // The invariants on what the instances report for v (see the top).
  void CheckInstances(int64_t v, const Fault& fault,
                      const std::map<std::string, v1::InstanceStatus>& statuses,
                      absl::Time killed_at, bool whole_version_aborted) {
    ReadEngineLogs(v);
    for (Instance& inst : instances_) {
      const bool hit = Hits(fault, inst);
      auto it = statuses.find(inst.id);
      const v1::InstanceStatus* s = it == statuses.end() ? nullptr : &it->second;
      const bool committed = s != nullptr &&
                             s->state() == v1::INSTANCE_STATE_COMMITTED &&
                             s->version() == v;
      if (committed) {
        ++inst.commits;
        if (s->committed_version() != v) {
          Violation(v, absl::StrCat(inst.id, " COMMITTED at v", v,
                                    " reports committed_version ",
                                    s->committed_version()));
        }
        for (EngineRank& r : inst.ranks) {
          CheckArena(v, inst, r, v, "reported COMMITTED");
          r.held = v;
        }
        CheckEngineLogs(v, inst, fault);
        if (inst.recovering && v >= inst.restarted_before) {
          const absl::Duration took = absl::Now() - inst.hit_at;
          const int versions = static_cast<int>(v - inst.restarted_before + 1);
          inst.max_recovery = std::max(inst.max_recovery, took);
          inst.max_recovery_versions = std::max(inst.max_recovery_versions, versions);
          inst.recovering = false;
        }
      } else {
        const std::string what =
            s == nullptr
                ? std::string("absent from the outcome")
                : absl::StrCat(v1::InstanceState_Name(s->state()), " at v",
                               s->version(), s->dirty() ? " (dirty)" : "",
                               ": ", s->abort_reason());
        (s == nullptr && !whole_version_aborted ? inst.absent : inst.aborts) += 1;
        if (s != nullptr && s->dirty()) {
          for (EngineRank& r : inst.ranks) r.held = -1;
        }
        if (!hit && !inst.recovering) {
          Violation(v, absl::StrCat(inst.id, " was not hit by the fault but "
                                    "did not commit: ", what));
        } else if (!hit && inst.recovering &&
                   v - inst.restarted_before + 1 >= kRecoveryVersions) {
          Violation(v, absl::StrCat(inst.id, " has not committed within ",
                                    kRecoveryVersions,
                                    " versions after its restart: ", what));
        }
      }
      if (hit) {  // recovery is timed from the latest fault that hit it
        ++inst.hits;
        inst.hit_at = std::min(killed_at, absl::Now());
        inst.recovering = true;
        inst.restarted_before = v + 1;
      }
      // A clean abort writes nothing: every rank still holds what it held.
      if (!committed) {
        for (EngineRank& r : inst.ranks) {
          if (r.held >= 0) CheckArena(v, inst, r, r.held, "after a clean abort");
        }
      }
    }
  }

  // Maps rank r's live arena (by its current or just-killed process's pid)
  // and compares every live byte with version `want`'s pattern.
  void CheckArena(int64_t v, const Instance& inst, const EngineRank& r,
                  int64_t want, const char* why) {
    const pid_t pid = r.process->pid();
    const std::string prefix =
        absl::StrCat("ferry-", inst.id, ".tp", r.tp_rank, "-", pid, "-");
    std::string name;
    for (const std::string& n : TaggedShm()) {
      if (absl::StartsWith(n, prefix)) name = n;
    }
    if (name.empty()) {
      Violation(v, absl::StrCat(inst.id, ".tp", r.tp_rank, " (pid ", pid,
                                "): no arena ", prefix, "* in /dev/shm"));
      return;
    }
    const RankCheck& check = checks_[r.tp_rank];
    const int fd = open(("/dev/shm/" + name).c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st {};
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size < check.arena_bytes) {
      if (fd >= 0) close(fd);
      Violation(v, absl::StrCat("cannot map ", name));
      return;
    }
    void* map = mmap(nullptr, check.arena_bytes, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
      Violation(v, absl::StrCat("cannot map ", name));
      return;
    }
    const uint8_t* base = static_cast<const uint8_t*>(map);
    int bad = 0;
    std::string first;
    for (const Piece& p : check.pieces) {
      absl::Status s = CheckPiece(want, schema_.spec.params[p.param], p, base);
      if (!s.ok() && bad++ == 0) first = std::string(s.message());
    }
    munmap(map, check.arena_bytes);
    ++arena_checks_;
    if (bad > 0) {
      Violation(v, absl::StrCat(inst.id, ".tp", r.tp_rank, " ", why, ": ", bad,
                                " of ", check.pieces.size(),
                                " live pieces differ from version ", want,
                                "; first: ", first));
    }
  }

  // Ranks whose log shows a commit later than what the soak knows they
  // hold were filled by a peer delivery: they hold that version now.
  // Returns how many ranks it learned of (each checked byte for byte).
  int LearnBootstraps(int64_t v) {
    ReadEngineLogs(v);
    int learned = 0;
    for (Instance& inst : instances_) {
      for (EngineRank& r : inst.ranks) {
        if (r.held < 0 || r.last_ok_commit <= r.held) continue;
        r.held = r.last_ok_commit;
        CheckArena(v, inst, r, r.held, "bootstrapped from a peer");
        ++bootstrapped_ranks_;
        ++learned;
      }
    }
    return learned;
  }

  void ReadEngineLogs(int64_t v) {
    for (Instance& inst : instances_) {
      for (EngineRank& r : inst.ranks) {
        for (const std::string& line : r.tail->NewLines()) {
          const size_t at = line.find("] COMMIT v");
          int64_t n = 0;
          if (at != std::string::npos) {
            const std::string rest = line.substr(at + 10);
            const size_t colon = rest.find(':');
            if (colon != std::string::npos &&
                absl::SimpleAtoi(rest.substr(0, colon), &n) &&
                rest.compare(colon, 4, ": OK") == 0) {
              r.last_ok_commit = std::max(r.last_ok_commit, n);
            }
          }
          if (line.find("MISMATCH") != std::string::npos) {
            ++r.mismatch_lines;
            Violation(v, absl::StrCat(inst.id, ".tp", r.tp_rank,
                                      " logged: ", line));
          }
        }
      }
    }
  }

  // Each rank of an instance that committed v logs "COMMIT v: OK" (its own
  // check of every live byte), unless the fault killed it or its daemon:
  // COMMIT needs no ack, so a member killed just after the coordinator
  // decided COMMITTED may take it with it (the rank then registers again
  // holding v-1 and hears of v no more; its bytes are checked above).
  void CheckEngineLogs(int64_t v, Instance& inst, const Fault& fault) {
    if (fault.kind == FaultKind::kMember && Hits(fault, inst)) return;
    for (EngineRank& r : inst.ranks) {
      if (Victim(fault) == r.process.get() || !r.process->alive()) continue;
      const bool logged = testing::Eventually(
          [&] {
            ReadEngineLogs(v);
            return r.last_ok_commit >= v;
          },
          kEngineLogDeadline);
      if (!logged) {
        Violation(v, absl::StrCat(inst.id, ".tp", r.tp_rank,
                                  " did not log COMMIT v", v, ": OK; log ",
                                  r.process->log()));
      }
    }
  }

  // -- restarts ------------------------------------------------------------

  void Restart(int64_t v, const Fault& fault) {
    if (fault.kind == FaultKind::kNone) return;
    Child* victim = Victim(fault);
    const pid_t pid = victim->pid();
    victim->Kill9();  // already dead and reaped: a no-op
    removed_shm_ += UnlinkShmOf(pid);
    switch (fault.kind) {
      case FaultKind::kNone: break;
      case FaultKind::kEngine: {
        Instance& inst = instances_[fault.target / 2];
        StartEngine(inst, inst.ranks[fault.target % 2]);
        break;
      }
      case FaultKind::kTrainer:
        StartTrainerRank1(true);
        break;
      case FaultKind::kMember:
        StartDaemon(fault.target == 0 ? b_ : c_, v + 1);
        break;
    }
    WaitReady(v);
  }

  void WaitReady(int64_t v) {
    const absl::Time start = absl::Now();
    std::string why;
    if (!testing::Eventually([&] { return StreamReady(&why); },
                             kReadyDeadline)) {
      Violation(v, absl::StrCat("the cluster is not ready ",
                                absl::FormatDuration(kReadyDeadline),
                                " after the restart: ", why));
    }
    max_ready_wait_ = std::max(max_ready_wait_, absl::Now() - start);
  }

  // A process that exited without being killed is a violation; it is
  // started again so that the soak goes on.
  void CheckUnexpectedExits(int64_t v) {
    bool restarted = false;
    for (Daemon* d : {&b_, &c_, &a_}) {
      if (d->process->alive()) continue;
      Violation(v, absl::StrCat("daemon ", d->node, " exited on its own (",
                                d->process->exit_code(), "); log ",
                                d->process->log()));
      REQUIRE(d != &a_);  // the coordinator is not restarted
      removed_shm_ += UnlinkShmOf(d->process->pid());
      StartDaemon(*d, v + 1);
      restarted = true;
    }
    for (Instance& inst : instances_) {
      for (EngineRank& r : inst.ranks) {
        if (r.process->alive()) continue;
        Violation(v, absl::StrCat(inst.id, ".tp", r.tp_rank,
                                  " exited on its own (", r.process->exit_code(),
                                  "); log ", r.process->log()));
        removed_shm_ += UnlinkShmOf(r.process->pid());
        StartEngine(inst, r);
        inst.recovering = true;
        inst.hit_at = absl::Now();
        inst.restarted_before = v + 1;
        restarted = true;
      }
    }
    if (!trainer1_->alive()) {
      Violation(v, absl::StrCat("trainer rank 1 exited on its own (",
                                trainer1_->exit_code(), "); log ",
                                trainer1_->log()));
      removed_shm_ += UnlinkShmOf(trainer1_->pid());
      StartTrainerRank1(true);
      restarted = true;
    }
    if (restarted) WaitReady(v);
  }

  // -- resources -----------------------------------------------------------

  void SampleResources(int64_t v) {
    for (Generation& g : generations_) {
      const Daemon* d = g.node == a_.node ? &a_ : g.node == b_.node ? &b_ : &c_;
      if (d->generation != g.generation || !d->process->alive()) continue;
      const ResourceSample s = SampleOf(g.pid);
      g.last = s;
      g.last_version = v;
      g.max_private_kb = std::max(g.max_private_kb, s.private_kb());
      g.max_rss_kb = std::max(g.max_rss_kb, s.rss_kb);
      g.max_fds = std::max(g.max_fds, s.fds);
      g.max_maps = std::max(g.max_maps, s.shm_maps);
      const int64_t warm = g.generation == 0 ? kWarmup : kRestartWarmup;
      if (!g.base && v >= g.started + warm - 1) {
        g.base = s;
        g.base_version = v;
      }
    }
    const int shm = static_cast<int>(TaggedShm().size());
    if (v % 10 == 0) {  // the trend, for a person reading the log
      std::string line = absl::StrCat("resources at v", v, ":");
      for (const Daemon* d : {&a_, &b_, &c_}) {
        const ResourceSample r = SampleOf(d->process->pid());
        absl::StrAppend(&line, " ", d->node, ".", d->generation, " rss ",
                        r.rss_kb >> 10, " MiB (private ", r.private_kb() >> 10,
                        ") maps ", r.shm_maps, " fds ", r.fds, " threads ",
                        r.threads, ";");
      }
      std::printf("%s shm %d\n", line.c_str(), shm);
    }
    if (v == kWarmup) shm_base_ = shm;
    shm_last_ = shm;
    shm_peak_ = std::max(shm_peak_, shm);
  }

  void CheckResources() {
    for (const Generation& g : generations_) {
      if (!g.base || g.last_version - g.base_version < kMinJudgedVersions) {
        continue;
      }
      const std::string who =
          absl::StrCat(g.node, " generation ", g.generation, " (v",
                       g.base_version, " -> v", g.last_version, "): ");
      const int64_t floor_kb =
          g.node == a_.node ? kPrivateFloorKb : kMemberPrivateFloorKb;
      const int64_t private_limit = std::max<int64_t>(
          g.base->private_kb() * (1 + kPrivateGrowth),
          g.base->private_kb() + floor_kb);
      if (g.last.private_kb() > private_limit) {
        Violation(g.last_version,
                  absl::StrCat(who, "private RSS grew ", g.base->private_kb(),
                               " -> ", g.last.private_kb(), " kB (limit ",
                               private_limit, ")"));
      }
      if (g.last.shm_maps > g.base->shm_maps + kMapSlack) {
        Violation(g.last_version,
                  absl::StrCat(who, "shm mappings grew ", g.base->shm_maps,
                               " -> ", g.last.shm_maps));
      }
      if (g.last.fds > g.base->fds + kFdSlack) {
        Violation(g.last_version,
                  absl::StrCat(who, "open fds grew ", g.base->fds, " -> ",
                               g.last.fds));
      }
    }
    if (shm_base_ > 0 && shm_last_ > shm_base_ + kShmSlack) {
      Violation(g_config.versions,
                absl::StrCat("/dev/shm entries grew ", shm_base_, " -> ",
                             shm_last_));
    }
  }

  // -- the end -------------------------------------------------------------

  void Shutdown() {
    const int64_t end = g_config.versions + 1;
    const int t1 = trainer1_->CloseStdinAndWait(absl::Seconds(15));
    if (t1 != 0) {
      Violation(end, absl::StrCat("trainer rank 1 exited ", t1, " on EOF; log ",
                                  trainer1_->log()));
    }
    source_.reset();
    trainer_arena_.reset();
    for (Instance& inst : instances_) {
      for (EngineRank& r : inst.ranks) {
        // 0: every version it saw committed and matched; 1: it also saw
        // aborts (expected after faults). Mismatches were checked per line.
        const int code = r.process->Stop(SIGTERM, absl::Seconds(15));
        ReadEngineLogs(end);
        if (code != 0 && code != 1) {
          Violation(end, absl::StrCat(inst.id, ".tp", r.tp_rank, " exited ",
                                      code, " on SIGTERM; log ",
                                      r.process->log()));
        }
      }
    }
    for (Daemon* d : {&b_, &c_, &a_}) {
      const int code = d->process->Stop(SIGTERM, absl::Seconds(15));
      if (code != 0) {
        Violation(end, absl::StrCat(d->node, " exited ", code,
                                    " on SIGTERM; log ", d->process->log()));
      }
    }
    // Every process exited cleanly: none may leave a /dev/shm entry.
    const std::vector<std::string> left = TaggedShm();
    if (!left.empty()) {
      Violation(end, absl::StrCat(left.size(), " /dev/shm entries left after "
                                  "a clean shutdown: ",
                                  absl::StrJoin(left, " ")));
    }
  }

  void PrintSummary(absl::Duration wall) {
    auto ms = [](absl::Duration d) {
      return absl::StrCat(absl::ToInt64Milliseconds(d), " ms");
    };
    std::printf("\n==== chaos soak summary: seed %llu, %d versions, %s wall ====\n",
                static_cast<unsigned long long>(g_config.seed), g_config.versions,
                absl::FormatDuration(absl::Trunc(wall, absl::Seconds(1))).c_str());
    std::printf("faults: %d engine rank, %d trainer rank, %d member daemon "
                "(%d whole-version aborts)\n",
                faults_[1], faults_[2], faults_[3], whole_version_aborts_);
    std::printf("typical version %s, slowest %s, longest wait for the "
                "cluster after a restart %s; %d arena checks; %d stale shm "
                "entries of killed processes removed\n",
                ms(typical_).c_str(), ms(max_version_time_).c_str(),
                ms(max_ready_wait_).c_str(), arena_checks_, removed_shm_);
    std::printf("ranks filled from a peer instance (bootstrap) between "
                "versions: %d\n", bootstrapped_ranks_);
    std::printf("%-14s %-5s %7s %6s %6s %4s %8s %7s %12s %6s\n", "instance",
                "node", "commits", "aborts", "absent", "hits", "restarts",
                "relayed", "max recovery", "(vers)");
    for (const Instance& inst : instances_) {
      std::printf("%-14s %-5s %7d %6d %6d %4d %8d %7d %12s %6d\n",
                  inst.id.c_str(), inst.daemon->node.c_str(), inst.commits,
                  inst.aborts, inst.absent, inst.hits,
                  inst.ranks[0].starts + inst.ranks[1].starts - 2, inst.relayed,
                  ms(inst.max_recovery).c_str(), inst.max_recovery_versions);
    }
    std::printf("resources per daemon generation, after warm-up / at the "
                "end / largest (MiB; judged: lived %d versions past warm-up)\n",
                kMinJudgedVersions);
    std::printf("%-7s %3s %-9s %-6s %-16s %-16s %-12s %-12s\n", "daemon",
                "gen", "versions", "judged", "private RSS", "VmRSS",
                "shm maps", "fds");
    for (const Generation& g : generations_) {
      const bool judged =
          g.base && g.last_version - g.base_version >= kMinJudgedVersions;
      const ResourceSample base = g.base.value_or(ResourceSample());
      std::printf("%-7s %3d %-9s %-6s %-16s %-16s %-12s %-12s\n",
                  g.node.c_str(), g.generation,
                  absl::StrCat(g.started, "-", g.last_version).c_str(),
                  judged ? "yes" : "no",
                  absl::StrCat(base.private_kb() >> 10, "/",
                               g.last.private_kb() >> 10, "/",
                               g.max_private_kb >> 10).c_str(),
                  absl::StrCat(base.rss_kb >> 10, "/", g.last.rss_kb >> 10, "/",
                               g.max_rss_kb >> 10).c_str(),
                  absl::StrCat(base.shm_maps, "/", g.last.shm_maps, "/",
                               g.max_maps).c_str(),
                  absl::StrCat(base.fds, "/", g.last.fds, "/", g.max_fds).c_str());
    }
    std::printf("/dev/shm entries of the soak: %d after warm-up, %d at the "
                "end, %d at most\n",
                shm_base_, shm_last_, shm_peak_);
    std::printf("violations: %zu\n", violations_.size());
    for (const std::string& s : violations_) std::printf("  %s\n", s.c_str());
    std::fflush(stdout);
  }

  void Violation(int64_t v, const std::string& what) {
    const std::string line = absl::StrCat("v", v, ": ", what);
    std::printf("VIOLATION %s\n", line.c_str());
    std::fflush(stdout);
    violations_.push_back(line);
  }

  std::string dir_;
  std::string tag_;
  std::mt19937_64 rng_;
  ModelSchema schema_;
  std::vector<RankCheck> checks_;  // by engine tp rank

  Daemon a_, b_, c_;
  const Connection* conn_ = nullptr;  // a_'s
  std::vector<Instance> instances_;
  RankLayout trainer_layout_;
  std::unique_ptr<SharedTensorArena> trainer_arena_;
  std::unique_ptr<SourceClient> source_;  // rank 0
  std::unique_ptr<Child> trainer1_;
  int trainer1_starts_ = 0;
  int64_t trainer1_started_unix_ms_ = 0;

  absl::Duration typical_ = absl::Milliseconds(200);  // until measured
  std::vector<absl::Duration> warmup_durations_;
  absl::Duration max_version_time_, max_ready_wait_;
  std::vector<Generation> generations_;
  int shm_base_ = 0, shm_last_ = 0, shm_peak_ = 0;
  int faults_[4] = {0, 0, 0, 0};
  int whole_version_aborts_ = 0;
  int bootstrapped_ranks_ = 0;
  int arena_checks_ = 0;
  int removed_shm_ = 0;
  std::vector<std::string> violations_;
  bool passed_ = false;  // logs are removed only then
};

TEST_CASE("chaos soak: kill -9 trainer ranks, engine ranks and member "
          "daemons at random points; every version checked",
          "[soak]") {
  ChaosSoak soak;
  soak.Run();
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  Catch::Session session;
  int versions = -1;
  using Catch::clara::Opt;
  session.cli(session.cli() |
              Opt(versions, "n")["--soak_versions"](
                  "versions to run (default 100, or $FERRY_SOAK_VERSIONS)"));
  if (int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (const char* env = std::getenv("FERRY_SOAK_VERSIONS");
      versions < 0 && env != nullptr) {
    absl::SimpleAtoi(env, &versions);
  }
  if (versions > 0) ferry::g_config.versions = versions;
  if (ferry::g_config.versions < ferry::kWarmup + ferry::kCooldown + 1) {
    std::fprintf(stderr, "--soak_versions must be > %d\n",
                 ferry::kWarmup + ferry::kCooldown);
    return 2;
  }
  // A fixed seed by default, so `bazel test //...` runs the same schedule
  // on every machine; FERRY_SOAK_SEED=random explores, and the summary line
  // prints the seed to replay.
  uint64_t seed = ferry::kDefaultSeed;
  if (const char* env = std::getenv("FERRY_SOAK_SEED");
      env != nullptr && *env != '\0') {
    if (std::string_view(env) == "random") {
      seed = std::random_device{}();
    } else if (!absl::SimpleAtoi(env, &seed)) {
      std::fprintf(stderr, "FERRY_SOAK_SEED=%s is neither a number nor "
                   "\"random\"\n", env);
      return 2;
    }
  }
  ferry::g_config.seed = seed;
  struct sigaction sa {};
  sa.sa_handler = ferry::OnFatalSignal;
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  return session.run();
}
