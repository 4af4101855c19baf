// FleetCluster: a fleet on this machine, for the fleet benchmark and the
// fleet fault tests: real ferryd processes (a coordinator, fleet-0, and
// members fleet-1..N joined to it over mutual TLS on loopback), and one
// fleet_ranks process per daemon holding that node's ranks as threads.
//
// The shape: `ranks` in all, as a trainer of S source ranks spread round
// robin over every daemon (the coordinator's node too) and TP `tp` engine
// instances "fleet-i-<n>" spread round robin over the members, each
// instance on one node (tensor parallelism stays within a node). About a
// quarter of the ranks are the trainer's: S = ranks - tp * instances with
// instances = (3 * ranks / 4) / tp, as a 1,024-rank fleet has a 256-rank
// trainer and 96 TP-8 instances.
//
// Threading: one thread at a time.
#ifndef FERRY_TESTS_FLEET_FLEET_CLUSTER_H_
#define FERRY_TESTS_FLEET_FLEET_CLUSTER_H_

#include <sys/types.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "tests/support/child_process.h"

namespace ferry {
namespace testing {

struct FleetShape {
  int ranks = 16;
  int members = 15;
  int tp = 8;
  // The trainer's ranks are on daemons 0 .. trainer_nodes-1 (0: on every
  // daemon).
  int trainer_nodes = 0;
  // Added to every ferryd's command line (e.g. "--lease_ms=3000").
  std::vector<std::string> ferryd_flags;
  std::string ferryd;       // the binary ("": found in the runfiles)
  std::string ranks_binary; // fleet_ranks ("": found in the runfiles)
};

// What one version did, as the trainer ranks saw it.
struct FleetVersion {
  int64_t version = 0;
  absl::Duration wall;  // the first BeginVersion .. the last return
  int committed = 0, aborted = 0;
  std::vector<std::string> aborted_ids;  // "fleet-i-3(dirty)"
};

// A process's CPU, memory, threads and descriptors from /proc.
struct ProcessStats {
  double cpu_seconds = 0;  // user + system, since it started
  int64_t rss_bytes = 0;
  int threads = 0;
  int fds = 0;
};

class FleetCluster {
 public:
  // Starts the daemons and waits until every member has joined.
  static absl::StatusOr<std::unique_ptr<FleetCluster>> Start(FleetShape shape);
  ~FleetCluster();  // every process killed, the directory removed

  int sources() const { return sources_; }
  int instances() const { return instances_; }
  int daemons() const { return shape_.members + 1; }
  // Engine ranks on member `m` (1..members).
  int EngineRanksOn(int m) const;
  const std::string& dir() const { return dir_; }

  // Starts every node's fleet_ranks process and waits until each has
  // registered all its ranks; the time that took.
  absl::StatusOr<absl::Duration> RegisterRanks(absl::Duration timeout);

  // Publishes version v from every trainer rank at once; fails when a
  // trainer rank's PublishVersion failed or a process did not answer.
  absl::StatusOr<FleetVersion> Publish(int64_t v, absl::Duration timeout);
  // Publish's first half, for a fault injected while it runs: sends the
  // command only. FinishPublish reads the answers.
  absl::Status BeginPublish(int64_t v);
  absl::StatusOr<FleetVersion> FinishPublish(int64_t v, absl::Duration timeout);

  // Every engine rank that committed v compared its bytes with v's own;
  // the engine ranks at v, and fails on any byte that differs.
  absl::StatusOr<int> CheckBytes(int64_t v, absl::Duration timeout);

  // Waits until the coordinator lists every trainer and engine rank
  // registered, and no version or peer delivery in progress.
  absl::Status WaitComplete(absl::Duration timeout);

  // The coordinator's report of version v (GetProgress).
  absl::StatusOr<v1::GetProgressResponse> Progress(int64_t v);
  // The coordinator's ListStreams of the fleet's stream.
  absl::StatusOr<v1::StreamInfo> Stream();

  ProcessStats Stats(int daemon) const;  // 0: the coordinator
  pid_t DaemonPid(int daemon) const;

  // The engine instances on member m, e.g. {"fleet-i-0", "fleet-i-3"}.
  std::vector<std::string> InstancesOn(int m) const;

  // Engine ranks on node d block in on_pause from now on (Hold), or go on
  // (Release): a fault lands mid-version where a test wants it.
  absl::Status Hold(int d);
  absl::Status Release(int d);
  // How many times ranks registered again (a daemon restart, a lost
  // lease), over every node's ranks.
  absl::StatusOr<int> Reregistrations();

  // kill -9 of daemon d (its ranks process stays: its clients reconnect and
  // register again when it is back), and its restart on the same socket.
  void KillDaemon(int d);
  absl::Status RestartDaemon(int d);
  // SIGSTOP / SIGCONT of daemon d: a node that stops answering without
  // dying (what the coordinator sees of a node cut off from the network).
  void FreezeDaemon(int d);
  void ThawDaemon(int d);
  // The coordinator's connection (its unix socket).
  const Connection& coordinator() const { return *coordinator_; }

 private:
  explicit FleetCluster(FleetShape shape);
  absl::Status StartDaemon(int d);
  std::string Node(int d) const;
  int TrainerNodes() const;      // daemons 0 .. TrainerNodes()-1
  bool HasSources(int d) const;  // daemon d's node holds trainer ranks
  // Sends `command` to node d's ranks process; its answer, which must
  // start with `answer`.
  absl::StatusOr<std::string> Command(int d, const std::string& command,
                                      const std::string& answer);
  std::string Socket(int d) const;
  // Daemon d's ranks process's arguments.
  std::vector<std::string> RanksArgs(int d) const;

  FleetShape shape_;
  int sources_ = 0, instances_ = 0;
  std::string dir_;
  int coordinator_port_ = 0;
  std::vector<std::unique_ptr<ChildProcess>> daemons_;
  std::vector<std::unique_ptr<ChildProcess>> ranks_;  // per daemon; may be null
  std::unique_ptr<Connection> coordinator_;
};

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_FLEET_FLEET_CLUSTER_H_
