#include "tests/fleet/fleet_cluster.h"

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "tests/daemon/test_certs.h"
#include "tests/support/eventually.h"

namespace ferry {
namespace testing {
namespace {

int ReadPort(const std::string& file) {
  std::ifstream in(file);
  int port = 0;
  return in >> port && port > 0 ? port : 0;
}

// "published V start end committed aborted ids" into `out`.
absl::Status ParsePublished(const std::string& line, int64_t v,
                            int64_t* start_us, int64_t* end_us,
                            FleetVersion* out) {
  std::vector<std::string> w = absl::StrSplit(line, ' ');
  int64_t got = 0;
  if (w.size() != 7 || w[0] != "published" || !absl::SimpleAtoi(w[1], &got) ||
      got != v || !absl::SimpleAtoi(w[2], start_us) ||
      !absl::SimpleAtoi(w[3], end_us) ||
      !absl::SimpleAtoi(w[4], &out->committed) ||
      !absl::SimpleAtoi(w[5], &out->aborted)) {
    return absl::InternalError(
        absl::StrCat("version ", v, ": a ranks process answered \"", line,
                     "\""));
  }
  out->aborted_ids.clear();
  if (w[6] != "-") out->aborted_ids = absl::StrSplit(w[6], ',');
  return absl::OkStatus();
}

}  // namespace

FleetCluster::FleetCluster(FleetShape shape) : shape_(std::move(shape)) {
  instances_ = std::max(1, (3 * shape_.ranks / 4) / shape_.tp);
  sources_ = std::max(1, shape_.ranks - instances_ * shape_.tp);
}

absl::StatusOr<std::unique_ptr<FleetCluster>> FleetCluster::Start(
    FleetShape shape) {
  if (shape.ferryd.empty()) shape.ferryd = Runfile("daemon/ferryd");
  if (shape.ranks_binary.empty()) {
    shape.ranks_binary = Runfile("tests/fleet/fleet_ranks");
  }
  if (shape.ferryd.empty() || shape.ranks_binary.empty()) {
    return absl::NotFoundError(
        "ferryd or fleet_ranks is not in the runfiles (build with bazel)");
  }
  if (shape.members < 1 || shape.tp < 1 || shape.ranks < shape.tp + 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a fleet needs members >= 1 and ranks > tp; got ", shape.members,
        " members, ", shape.ranks, " ranks, tp ", shape.tp));
  }
  std::unique_ptr<FleetCluster> c(new FleetCluster(std::move(shape)));
  char tmpl[] = "/tmp/ferry-fleet-XXXXXX";
  if (mkdtemp(tmpl) == nullptr) return absl::InternalError("mkdtemp");
  c->dir_ = tmpl;
  c->daemons_.resize(c->daemons());
  c->ranks_.resize(c->daemons());
  if (absl::Status s = c->StartDaemon(0); !s.ok()) return s;
  if (!Eventually([&] {
        return (c->coordinator_port_ = ReadPort(c->dir_ + "/fleet-0.port")) > 0;
      }, absl::Seconds(30))) {
    return absl::DeadlineExceededError("the coordinator wrote no port file");
  }
  for (int d = 1; d < c->daemons(); ++d) {
    if (absl::Status s = c->StartDaemon(d); !s.ok()) return s;
  }
  ConnectionOptions o;
  o.address = "unix:" + c->Socket(0);
  o.rpc_timeout = absl::Seconds(60);
  absl::StatusOr<Connection> conn = Connection::Open(o);
  if (!conn.ok()) return conn.status();
  c->coordinator_ = std::make_unique<Connection>(*std::move(conn));
  // Every member joined and heartbeating.
  const int members = c->shape_.members;
  int joined = 0;
  if (!Eventually([&] {
        v1::GetHealthResponse health;
        auto ctx = c->coordinator_->NewContext(absl::Seconds(5));
        if (!c->coordinator_->inspection()
                 .GetHealth(ctx.get(), v1::GetHealthRequest(), &health)
                 .ok()) {
          return false;
        }
        joined = 0;
        for (const auto& p : health.peers()) joined += p.reachable();
        return joined == members;
      }, absl::Seconds(60), absl::Milliseconds(100))) {
    return absl::DeadlineExceededError(absl::StrCat(
        joined, " of ", members, " members joined the coordinator in 60 s"));
  }
  return c;
}

FleetCluster::~FleetCluster() {
  for (auto& r : ranks_) {
    if (r != nullptr) r->CloseStdinAndWait(absl::Seconds(10));
  }
  ranks_.clear();
  daemons_.clear();
  // FERRY_FLEET_KEEP=1 keeps the daemons' and ranks' logs.
  if (!dir_.empty() && std::getenv("FERRY_FLEET_KEEP") == nullptr) {
    const std::string rm = absl::StrCat("rm -rf '", dir_, "'");
    (void)std::system(rm.c_str());
  }
}

std::string FleetCluster::Node(int d) const { return absl::StrCat("fleet-", d); }

std::string FleetCluster::Socket(int d) const {
  return absl::StrCat(dir_, "/", Node(d), ".sock");
}

absl::Status FleetCluster::StartDaemon(int d) {
  std::vector<std::string> args = {
      "--node=" + Node(d), "--socket=" + Socket(d),
      // Members rejoin a restarted coordinator at the address they know.
      absl::StrCat("--listen=127.0.0.1:", d == 0 ? coordinator_port_ : 0),
      absl::StrCat("--port_file=", dir_, "/", Node(d), ".port"),
      "--logtostderr", "--v=0"};
  for (const std::string& f : TlsFlags(Node(d))) args.push_back(f);
  if (d > 0) {
    args.push_back(absl::StrCat("--coordinator=127.0.0.1:", coordinator_port_));
  }
  for (const std::string& f : shape_.ferryd_flags) args.push_back(f);
  ChildOptions o;
  o.log = absl::StrCat(dir_, "/", Node(d), ".log");
  // A restart appends to the log of the daemon it replaces.
  if (daemons_[d] != nullptr) o.log += absl::StrCat(".", DaemonPid(d));
  absl::StatusOr<std::unique_ptr<ChildProcess>> p =
      ChildProcess::Start(shape_.ferryd, std::move(args), o);
  if (!p.ok()) return p.status();
  daemons_[d] = *std::move(p);
  return absl::OkStatus();
}

int FleetCluster::TrainerNodes() const {
  return shape_.trainer_nodes > 0 ? std::min(shape_.trainer_nodes, daemons())
                                  : daemons();
}

bool FleetCluster::HasSources(int d) const {
  return d < TrainerNodes() && d < sources_;
}

int FleetCluster::EngineRanksOn(int m) const {
  int n = 0;
  for (int i = 0; i < instances_; ++i) n += 1 + i % shape_.members == m;
  return n * shape_.tp;
}

std::vector<std::string> FleetCluster::RanksArgs(int d) const {
  std::vector<std::string> sources, instances;
  for (int s = d; HasSources(d) && s < sources_; s += TrainerNodes()) {
    sources.push_back(absl::StrCat(s));
  }
  for (int i = 0; i < instances_; ++i) {
    if (d > 0 && 1 + i % shape_.members == d) {
      instances.push_back(absl::StrCat("fleet-i-", i));
    }
  }
  if (sources.empty() && instances.empty()) return {};
  return {"--socket=" + Socket(d),
          "--stream=fleet",
          absl::StrCat("--sources=", sources_),
          "--source_ranks=" + absl::StrJoin(sources, ","),
          "--instances=" + absl::StrJoin(instances, ","),
          absl::StrCat("--tp=", shape_.tp)};
}

absl::StatusOr<absl::Duration> FleetCluster::RegisterRanks(
    absl::Duration timeout) {
  const absl::Time start = absl::Now();
  for (int d = 0; d < daemons(); ++d) {
    std::vector<std::string> args = RanksArgs(d);
    if (args.empty()) continue;
    ChildOptions o;
    o.piped = true;
    o.log = absl::StrCat(dir_, "/ranks-", d, ".log");
    absl::StatusOr<std::unique_ptr<ChildProcess>> p =
        ChildProcess::Start(shape_.ranks_binary, std::move(args), o);
    if (!p.ok()) return p.status();
    ranks_[d] = *std::move(p);
  }
  for (int d = 0; d < daemons(); ++d) {
    if (ranks_[d] == nullptr) continue;
    std::optional<std::string> line =
        ranks_[d]->ReadLine(std::max(absl::ZeroDuration(),
                                     start + timeout - absl::Now()));
    if (!line.has_value() || !absl::StartsWith(*line, "ready ")) {
      return absl::InternalError(absl::StrCat(
          "node ", Node(d), "'s ranks did not register: ",
          line.value_or("no answer"), " (", ranks_[d]->log(), ")"));
    }
  }
  return absl::Now() - start;
}

absl::Status FleetCluster::BeginPublish(int64_t v) {
  for (int d = 0; d < daemons(); ++d) {
    if (ranks_[d] == nullptr || !HasSources(d)) continue;
    if (!ranks_[d]->WriteLine(absl::StrCat("publish ", v))) {
      return absl::InternalError(
          absl::StrCat("node ", Node(d), "'s ranks process is gone"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<FleetVersion> FleetCluster::FinishPublish(
    int64_t v, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  FleetVersion out;
  out.version = v;
  int64_t first = INT64_MAX, last = 0;
  absl::Status error;
  for (int d = 0; d < daemons(); ++d) {
    if (ranks_[d] == nullptr || !HasSources(d)) continue;
    // An earlier version's answer that came after its caller stopped
    // waiting is skipped.
    const std::string this_version = absl::StrCat(" ", v, " ");
    std::optional<std::string> line;
    while ((line = ranks_[d]->ReadLine(
                std::max(absl::ZeroDuration(), deadline - absl::Now())))
               .has_value() &&
           (absl::StartsWith(*line, "published ") ||
            absl::StartsWith(*line, "failed ")) &&
           line->find(this_version) != line->find(' ')) {
    }
    if (!line.has_value()) {
      error.Update(absl::DeadlineExceededError(absl::StrCat(
          "version ", v, ": node ", Node(d), "'s trainer ranks did not "
          "answer")));
      continue;
    }
    int64_t start_us = 0, end_us = 0;
    FleetVersion mine;
    absl::Status s = ParsePublished(*line, v, &start_us, &end_us, &mine);
    if (!s.ok()) {
      error.Update(s);
      continue;
    }
    first = std::min(first, start_us);
    last = std::max(last, end_us);
    if (d == 0) {
      out.committed = mine.committed;
      out.aborted = mine.aborted;
      out.aborted_ids = mine.aborted_ids;
    }
  }
  if (!error.ok()) return error;
  out.wall = absl::Microseconds(last - first);
  return out;
}

absl::StatusOr<FleetVersion> FleetCluster::Publish(int64_t v,
                                                   absl::Duration timeout) {
  if (absl::Status s = BeginPublish(v); !s.ok()) return s;
  return FinishPublish(v, timeout);
}

absl::StatusOr<int> FleetCluster::CheckBytes(int64_t v, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  int at = 0;
  for (int d = 1; d < daemons(); ++d) {
    if (ranks_[d] == nullptr || EngineRanksOn(d) == 0) continue;
    ranks_[d]->WriteLine(absl::StrCat("check ", v));
  }
  for (int d = 1; d < daemons(); ++d) {
    if (ranks_[d] == nullptr || EngineRanksOn(d) == 0) continue;
    std::optional<std::string> line =
        ranks_[d]->ReadLine(std::max(absl::ZeroDuration(), deadline - absl::Now()));
    std::vector<std::string> w =
        absl::StrSplit(line.value_or(""), ' ');
    int here = 0, not_here = 0;
    int64_t bad = 0;
    if (w.size() != 5 || w[0] != "checked" || !absl::SimpleAtoi(w[2], &here) ||
        !absl::SimpleAtoi(w[3], &not_here) || !absl::SimpleAtoi(w[4], &bad)) {
      return absl::InternalError(absl::StrCat(
          "check ", v, ": node ", Node(d), " answered \"",
          line.value_or("nothing"), "\""));
    }
    if (bad != 0) {
      return absl::DataLossError(absl::StrCat(
          "version ", v, ": ", bad, " bytes differ from the trainer's on the "
          "engine ranks of node ", Node(d), " that committed it"));
    }
    at += here;
  }
  return at;
}

absl::Status FleetCluster::WaitComplete(absl::Duration timeout) {
  std::string missing = "no answer";
  const bool complete = Eventually(
      [&] {
        absl::StatusOr<v1::StreamInfo> s = Stream();
        if (!s.ok()) {
          missing = s.status().ToString();
          return false;
        }
        int ranks = 0;
        for (const v1::InstanceInfo& i : s->instances()) {
          ranks += i.registered_tp_ranks_size();
        }
        const bool delivering =
            s->has_delivery() &&
            !s->delivery().settled();
        missing = absl::StrCat(
            s->registered_ranks_size(), " of ", sources_, " trainer ranks, ",
            ranks, " of ", instances_ * shape_.tp, " engine ranks, version ",
            s->version_in_progress(), " in progress",
            delivering ? ", a peer delivery running" : "");
        return s->registered_ranks_size() == sources_ &&
               ranks == instances_ * shape_.tp &&
               s->version_in_progress() == 0 && !delivering;
      },
      timeout, absl::Milliseconds(50));
  if (complete) return absl::OkStatus();
  return absl::DeadlineExceededError(
      absl::StrCat("the fleet is not complete after ",
                   absl::FormatDuration(timeout), ": ", missing));
}

absl::StatusOr<v1::GetProgressResponse> FleetCluster::Progress(int64_t v) {
  v1::GetProgressRequest req;
  req.set_stream("fleet");
  req.set_version(v);
  v1::GetProgressResponse resp;
  auto ctx = coordinator_->NewContext(absl::Seconds(30));
  grpc::Status s = coordinator_->inspection().GetProgress(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpcStatus(s, "GetProgress");
  return resp;
}

absl::StatusOr<v1::StreamInfo> FleetCluster::Stream() {
  v1::ListStreamsRequest req;
  req.set_stream("fleet");
  v1::ListStreamsResponse resp;
  auto ctx = coordinator_->NewContext(absl::Seconds(30));
  grpc::Status s = coordinator_->inspection().ListStreams(ctx.get(), req, &resp);
  if (!s.ok()) return FromGrpcStatus(s, "ListStreams");
  if (resp.streams_size() != 1) return absl::NotFoundError("no stream fleet");
  return resp.streams(0);
}

pid_t FleetCluster::DaemonPid(int d) const { return daemons_[d]->pid(); }

ProcessStats FleetCluster::Stats(int d) const {
  ProcessStats out;
  const pid_t pid = DaemonPid(d);
  std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
  std::string text((std::istreambuf_iterator<char>(stat)),
                   std::istreambuf_iterator<char>());
  // Fields after the command's closing parenthesis: utime is the 14th
  // field of the line, stime the 15th.
  const size_t paren = text.rfind(')');
  if (paren != std::string::npos) {
    std::vector<std::string> f =
        absl::StrSplit(text.substr(paren + 2), ' ', absl::SkipEmpty());
    int64_t utime = 0, stime = 0;
    if (f.size() > 12 && absl::SimpleAtoi(f[11], &utime) &&
        absl::SimpleAtoi(f[12], &stime)) {
      out.cpu_seconds =
          static_cast<double>(utime + stime) / sysconf(_SC_CLK_TCK);
    }
  }
  std::ifstream status(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(status, line)) {
    std::vector<std::string> f = absl::StrSplit(line, absl::ByAnyChar(" \t"),
                                                absl::SkipEmpty());
    if (f.size() >= 2 && f[0] == "VmRSS:") {
      int64_t kb = 0;
      if (absl::SimpleAtoi(f[1], &kb)) out.rss_bytes = kb * 1024;
    } else if (f.size() >= 2 && f[0] == "Threads:") {
      (void)absl::SimpleAtoi(f[1], &out.threads);
    }
  }
  if (DIR* fds = opendir(absl::StrCat("/proc/", pid, "/fd").c_str())) {
    while (dirent* e = readdir(fds)) out.fds += e->d_name[0] != '.';
    closedir(fds);
  }
  return out;
}

std::vector<std::string> FleetCluster::InstancesOn(int m) const {
  std::vector<std::string> ids;
  for (int i = 0; i < instances_; ++i) {
    if (m > 0 && 1 + i % shape_.members == m) {
      ids.push_back(absl::StrCat("fleet-i-", i));
    }
  }
  return ids;
}

absl::StatusOr<std::string> FleetCluster::Command(int d,
                                                  const std::string& command,
                                                  const std::string& answer) {
  if (ranks_[d] == nullptr || !ranks_[d]->WriteLine(command)) {
    return absl::FailedPreconditionError(
        absl::StrCat("node ", Node(d), " has no ranks process"));
  }
  // A publish whose answer came after its caller stopped waiting (a fault
  // test expects it to fail) may still be in the pipe: skipped.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::optional<std::string> line;
  while ((line = ranks_[d]->ReadLine(
              std::max(absl::ZeroDuration(), deadline - absl::Now())))
             .has_value() &&
         !absl::StartsWith(*line, answer) &&
         (absl::StartsWith(*line, "published ") ||
          absl::StartsWith(*line, "failed "))) {
  }
  if (!line.has_value() || !absl::StartsWith(*line, answer)) {
    return absl::InternalError(absl::StrCat(
        "node ", Node(d), "'s ranks answered \"", line.value_or("nothing"),
        "\" to ", command));
  }
  return *line;
}

absl::Status FleetCluster::Hold(int d) {
  return Command(d, "hold", "held").status();
}

absl::Status FleetCluster::Release(int d) {
  return Command(d, "release", "released").status();
}

absl::StatusOr<int> FleetCluster::Reregistrations() {
  int total = 0;
  for (int d = 0; d < daemons(); ++d) {
    if (ranks_[d] == nullptr) continue;
    absl::StatusOr<std::string> line = Command(d, "stats", "stats ");
    if (!line.ok()) return line.status();
    std::vector<std::string> w = absl::StrSplit(*line, ' ');
    int again = 0;
    if (w.size() != 3 || !absl::SimpleAtoi(w[1], &again)) {
      return absl::InternalError(absl::StrCat("stats: \"", *line, "\""));
    }
    total += again;
  }
  return total;
}

void FleetCluster::KillDaemon(int d) { daemons_[d]->Kill9(); }

void FleetCluster::FreezeDaemon(int d) { kill(DaemonPid(d), SIGSTOP); }

void FleetCluster::ThawDaemon(int d) { kill(DaemonPid(d), SIGCONT); }

absl::Status FleetCluster::RestartDaemon(int d) {
  if (d == 0) unlink((dir_ + "/fleet-0.port").c_str());
  // The same socket path: its clients find it again there.
  unlink(Socket(d).c_str());
  return StartDaemon(d);
}

}  // namespace testing
}  // namespace ferry
