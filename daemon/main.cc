// ferryd: the ferry weight-sync daemon (one per node). See docs/api.md for
// the API it serves and daemon/server.h for how it is assembled.
//
// SIGTERM or SIGINT: stop taking new versions, let versions in flight
// settle, end every stream, exit 0.
#include <csignal>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "common/flags_help.h"
#include "common/socket_path.h"
#include "common/version.h"
#include "core/limits.h"
#include "core/parallel_for.h"
#include "daemon/daemon_options.h"
#include "daemon/server.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "proto/convert.h"
#include "transport/tcp/host_rails.h"
#include "transport/ucx/ucx_channel.h"

DEFINE_string(socket, "",
              "Unix socket for local clients (trainer and engine ranks). "
              "Default: $FERRY_SOCKET, else "
              "$XDG_RUNTIME_DIR/ferry/ferryd.sock, else "
              "/tmp/ferry-$UID/ferryd.sock (the clients' rule); a "
              "system service typically uses /run/ferry/ferryd.sock. The "
              "directory is created mode 0700, the socket is mode 0600, and "
              "only this user (and root) may connect (checked per connection "
              "with SO_PEERCRED). Empty string with --nounix: none.");
DEFINE_bool(unix, true, "Listen on --socket.");
DEFINE_string(client_uids, "",
              "Other users whose processes may connect to --socket besides "
              "ferryd's own uid and root: a comma-separated list of uids, "
              "or 'all' (e.g. ferryd as root on a GPU node shared by "
              "several users). The socket directory is then 0711 and the "
              "socket 0666; ferryd maps a caller's shared memory only if "
              "that caller could open it itself.");
DEFINE_string(listen, "",
              "TCP address for peer daemons and remote ferryctl "
              "(host:port; port 0 picks a free one, printed to the log and "
              "written to --port_file). Served only with mutual TLS "
              "(--tls_cert, --tls_key, --tls_ca); the data channels to other "
              "daemons listen on the same host. Empty: no TCP listener "
              "(one node, clients on the unix socket).");
DEFINE_string(tls_cert, "",
              "This daemon's certificate (PEM), signed by the cluster CA, "
              "with CN = --node and the host names or IPs peers reach it at "
              "as subjectAltNames (deploy/make_certs.sh makes one).");
DEFINE_string(tls_key, "",
              "The certificate's private key (PEM; mode 0600, owned by "
              "ferryd's user).");
DEFINE_string(tls_ca, "",
              "The cluster CA (PEM) that signs every daemon's and remote "
              "ferryctl's certificate; a TCP caller without one is "
              "UNAUTHENTICATED.");
DEFINE_string(port_file, "",
              "If set, write the bound TCP port (decimal, newline) here once "
              "serving.");
DEFINE_string(node, "", "This node's name (default: the hostname).");
DEFINE_int64(lease_ms, 10000,
             "How long a registration lives without a Heartbeat, ms.");
DEFINE_int64(ack_timeout_ms, 30000,
             "How long a destination rank has to ack PREPARE, PAUSE or APPLY "
             "before its instance's version is aborted, ms.");
DEFINE_int64(relay_wait_ms, 2000,
             "How long a paused replica waits for the replica it relays "
             "from (the trainer sends each byte once) to finish pausing; "
             "after that it reads the trainer. 0: never wait for one still "
             "pausing.");
DEFINE_bool(exchange, false,
            "Pairs of replicas that read the trainer alike exchange the "
            "busiest trainer ranks' buckets: each reads half of them from "
            "the trainer and the other half from its partner once the "
            "partner holds them (core/exchange.h). Pays where the trainer's "
            "NICs are busier than the replicas' and a route between two "
            "nodes can use several NICs (UCX multi-rail); model it first "
            "with ferry_plan --cluster --exchange. Only the coordinator's "
            "flag counts.");
DEFINE_int64(version_timeout_ms, 120000,
             "How long a version may take after its first CommitVersion "
             "before unsettled instances are aborted, ms.");
DEFINE_bool(check_lock_order, false,
            "Abseil's lock-order (potential deadlock) checks on every mutex "
            "acquisition: a debugging aid that costs CPU on every lock.");
DEFINE_bool(gpus, true,
            "Use this node's GPUs for clients that register GPU memory (CUDA "
            "IPC); ferryd must see every GPU they use. Without a GPU, or "
            "built without CUDA, it serves host memory only and says why in "
            "`ferryctl health`.");
DEFINE_int64(gpu_channel_staging_mb, 64,
             "GPU memory between nodes travels over NCCL channels, each "
             "with two device staging slots of this many MiB (larger "
             "buckets move in chunks).");
DEFINE_int64(max_staging_mb, -1,
             "Staging (fallback tensors assembled for engines' own loaders) "
             "all instances together may hold, MiB; an instance that would "
             "need more aborts its version. -1: half the size of /dev/shm.");
DEFINE_bool(device_staging, true,
            "Engine ranks whose memory is on a GPU and that ask for it "
            "(the Python client with CUDA tensors does) get their fallback "
            "tensors in GPU memory ferryd allocates on their GPU and exports "
            "over CUDA IPC, counted against --max_staging_mb. "
            "--nodevice_staging: host shared memory, pinned, for every rank.");
DEFINE_int64(max_participants, ferry::Limits::kMaxParticipantsPerDaemon,
             "Participants (trainer and engine ranks, members' forwarded "
             "ones included) this daemon holds at once; registrations past "
             "it are RESOURCE_EXHAUSTED. At most 65536.");
DEFINE_int32(copy_threads, 0,
             "Threads copying host memory (0: min(4, cores)).");
DEFINE_int32(planning_threads, 0,
             "Threads that compute a plan (validation, layout resolution, "
             "per-rank plans), the calling thread included (0: the CPUs "
             "the machine reports, at most 8; 1: one thread).");
DEFINE_int32(transfer_workers, 8,
             "Instances whose transfers run at once (each on a worker "
             "thread): the replicas of a version land side by side, each "
             "bounded by its own routes. Routes to one node still take "
             "turns on its channel. 1: one instance at a time.");
DEFINE_bool(transfer_checksums, false,
            "Hash every delivered box of host memory (XXH3-64) where it "
            "leaves the source, while it is copied, and keep each "
            "instance's checksums of its committed version for `ferryctl "
            "verify` / Inspection.VerifyInstance. Off by default: it costs "
            "a read of every source byte per version, which on a small "
            "host slows same-node updates by half or more "
            "(docs/benchmarks.md). GPU memory is never hashed.");
DEFINE_string(coordinator, "",
              "Several nodes: the coordinator daemon's TCP address "
              "(host:port). This daemon then joins it as a member and "
              "heartbeats it (needs --listen and a --node unique in the "
              "cluster). Empty: this daemon is the coordinator.");
DEFINE_string(advertise, "",
              "host:port other daemons reach this one at (default: the "
              "--listen host, or the hostname for a wildcard, and the bound "
              "port).");
DEFINE_int64(peer_lease_ms, 10000,
             "Coordinator: how long a member daemon lives without a "
             "PeerHeartbeat, ms.");
DEFINE_int64(drain_timeout_ms, 10000,
             "On SIGTERM, how long versions in flight may take to settle.");
DEFINE_string(metrics_address, "",
              "Serve Prometheus metrics on http://HOST:PORT/metrics (plain "
              "HTTP, read-only: bind to an address only your scraper "
              "reaches, e.g. 127.0.0.1:9464). Empty: off.");
DEFINE_string(ucx_nodes, "",
              "Send host memory to these nodes over UCX instead of TCP: a "
              "comma-separated list of node names, or * for every node "
              "(docs/operations.md, \"UCX between nodes\"). The receiving "
              "daemon follows the sender's choice. Empty: TCP to all.");
DEFINE_string(ucx_transports, "",
              "UCX_TLS of this daemon's UCX channels, e.g. rc,sm or tcp "
              "(both ends must share one). Empty: UCX's own choice, or "
              "UCX_TLS from the environment.");
DEFINE_string(rails, "",
              "Rails: the NICs this daemon's TCP channels to other nodes use, "
              "one channel per rail pair, a route's buckets striped over "
              "them (docs/operations.md, \"Rails\"): comma-separated "
              "interface names or addresses of this host, in rail order "
              "(rail i talks to rail i of the peer), or auto (every "
              "interface that is up, not loopback and holds an IPv4 "
              "address, by name). Empty: one rail, the kernel's choice.");
DEFINE_int64(bucket_mb, 64,
             "Coordinator: the largest bucket of a plan, MiB (larger boxes "
             "are split). Routes are striped over --rails a bucket at a "
             "time: lower it where routes carry fewer buckets than rails.");
DEFINE_int64(delta_shadow_mb, 0,
             "Delta versions (docs/operations.md, \"Delta versions\"): host "
             "memory this daemon may keep as shadows of the source buffers "
             "its routes to other nodes read (a copy of each, plus 1/16), so "
             "that a bucket whose destination holds the previous version "
             "goes as a patch of the 2-byte chunks that changed. 0: off, "
             "every byte sent. Set it on the daemons that send (the "
             "trainer's nodes; a relaying replica's).");
DEFINE_int64(channel_dead_after_ms, 10000,
             "A TCP channel between daemons whose peer leaves data "
             "unacknowledged, or keepalive probes unanswered, this long "
             "fails (TCP_USER_TIMEOUT), so a link that went down fails its "
             "route in about this long. 0: the kernel's defaults (~15 min).");

namespace {

std::string Hostname() {
  char name[256] = {0};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') {
    return "localhost";
  }
  return name;
}

// Setup, step 1: flags parsed (with ferry's own --help), logging to
// stderr, and the signals no thread should die of handled.
void ParseFlagsAndLog(int* argc, char*** argv) {
  gflags::SetUsageMessage(
      "ferryd: the ferry weight-sync daemon.\n"
      "  ferryd [--socket=PATH] [--listen=HOST:PORT --tls_cert=PEM\n"
      "         --tls_key=PEM --tls_ca=PEM] [--port_file=FILE]\n"
      "         [--lease_ms=N] [--ack_timeout_ms=N] [--version_timeout_ms=N]\n"
      "         [--copy_threads=N] [--planning_threads=N] [--node=NAME]\n"
      "         [--drain_timeout_ms=N]\n"
      "         [--metrics_address=HOST:PORT]\n"
      "         [--coordinator=HOST:PORT] [--advertise=HOST:PORT]\n"
      "         [--peer_lease_ms=N] [--transfer_checksums]\n"
      "Trainer and inference ranks register over the unix socket; operators\n"
      "use ferryctl over either. SIGTERM/SIGINT drain and exit 0.");
  gflags::SetVersionString(ferry::kDaemonVersion);
  ferry::ParseFlagsWithOwnHelp(argc, argv, __FILE__);
  FLAGS_logtostderr = true;
  google::InitGoogleLogging((*argv)[0]);
  // Debian's Abseil checks lock order on every acquisition unless told not
  // to: a few percent of a coordinator's CPU at fleet size
  // (docs/benchmarks.md, "A fleet on one coordinator").
  absl::SetMutexDeadlockDetectionMode(FLAGS_check_lock_order
                                          ? absl::OnDeadlockCycle::kAbort
                                          : absl::OnDeadlockCycle::kIgnore);
  // A crash prints its stack to the log; a peer that closes a socket is an
  // error status (MSG_NOSIGNAL), never a signal that kills the daemon.
  google::InstallFailureSignalHandler();
  std::signal(SIGPIPE, SIG_IGN);
}

// Setup, step 2: the shutdown signals blocked before any thread starts,
// so every thread inherits the mask and ServeUntilSignalled's sigwait is
// the only receiver. Returns them.
sigset_t BlockShutdownSignals() {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  return signals;
}

// Flags, step 1: every flag in its range, in the order ferryd has always
// checked them; the error names the flag.
absl::Status CheckFlags() {
  if (FLAGS_planning_threads < 0 || FLAGS_planning_threads > 64) {
    return absl::InvalidArgumentError("--planning_threads must be 0 to 64");
  }
  if (FLAGS_transfer_workers < 1 || FLAGS_transfer_workers > 256) {
    return absl::InvalidArgumentError("--transfer_workers must be 1 to 256");
  }
  if (!FLAGS_ucx_nodes.empty() && FLAGS_ucx_nodes != "*") {
    const std::vector<std::string> names = absl::StrSplit(FLAGS_ucx_nodes, ',');
    for (const std::string& n : names) {
      if (absl::Status s = ferry::ValidateName("--ucx_nodes", n); !s.ok()) {
        return absl::InvalidArgumentError(absl::StrCat(
            s.message(), " (a node name in --ucx_nodes=\"", FLAGS_ucx_nodes,
            "\", or * for every node)"));
      }
    }
  }
  if (!FLAGS_ucx_nodes.empty() || !FLAGS_ucx_transports.empty()) {
    // A machine without the transports asked for fails now, not at the
    // first version.
    if (absl::Status s = ferry::CheckUcxTransports(FLAGS_ucx_transports);
        !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--ucx_transports=\"", FLAGS_ucx_transports, "\": ", s.message()));
    }
  }
  if (FLAGS_delta_shadow_mb < 0 || FLAGS_delta_shadow_mb > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        "--delta_shadow_mb must be 0 to 2^30");
  }
  if (FLAGS_bucket_mb < 1 || FLAGS_bucket_mb > 4096) {
    return absl::InvalidArgumentError("--bucket_mb must be 1 to 4096");
  }
  if (FLAGS_channel_dead_after_ms < 0 ||
      FLAGS_channel_dead_after_ms > 3600 * 1000) {
    return absl::InvalidArgumentError(
        "--channel_dead_after_ms must be 0 to 3600000");
  }
  if (absl::StatusOr<std::vector<ferry::Rail>> rails =
          ferry::ResolveRails(FLAGS_rails, ferry::Limits::kMaxRails);
      !rails.ok()) {
    return rails.status();
  }
  if (FLAGS_peer_lease_ms <= 0) {
    return absl::InvalidArgumentError("--peer_lease_ms must be positive");
  }
  if (FLAGS_max_participants < 1 ||
      FLAGS_max_participants > ferry::Limits::kMaxParticipantsPerDaemon) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max_participants must be 1 to ",
                     ferry::Limits::kMaxParticipantsPerDaemon));
  }
  if (FLAGS_max_staging_mb > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError("--max_staging_mb must be at most 2^40");
  }
  if (!FLAGS_node.empty()) {
    // The node name goes into ids, messages and peers' lists.
    if (absl::Status s = ferry::ValidateName("--node", FLAGS_node); !s.ok()) {
      return s;
    }
  }
  if (FLAGS_relay_wait_ms < 0) {
    return absl::InvalidArgumentError("--relay_wait_ms must not be negative");
  }
  if (FLAGS_gpu_channel_staging_mb < 1 || FLAGS_gpu_channel_staging_mb > 16384) {
    return absl::InvalidArgumentError(
        "--gpu_channel_staging_mb must be in [1, 16384]");
  }
  if (FLAGS_lease_ms <= 0 || FLAGS_ack_timeout_ms <= 0 ||
      FLAGS_version_timeout_ms <= 0) {
    return absl::InvalidArgumentError(
        "--lease_ms, --ack_timeout_ms and --version_timeout_ms must be "
        "positive");
  }
  return absl::OkStatus();
}

// Flags, step 2: the checked flags as the Server's options.
ferry::DaemonOptions OptionsFromFlags() {
  ferry::DaemonOptions options;
  options.node = FLAGS_node.empty() ? Hostname() : FLAGS_node;
  options.socket_path =
      FLAGS_unix
          ? (FLAGS_socket.empty() ? ferry::DefaultSocketPath() : FLAGS_socket)
          : "";
  options.client_uids = FLAGS_client_uids;
  options.listen_address = FLAGS_listen;
  options.tls.cert = FLAGS_tls_cert;
  options.tls.key = FLAGS_tls_key;
  options.tls.ca = FLAGS_tls_ca;
  options.lease_ms = FLAGS_lease_ms;
  options.ack_timeout_ms = FLAGS_ack_timeout_ms;
  options.version_timeout_ms = FLAGS_version_timeout_ms;
  options.relay_wait_ms = FLAGS_relay_wait_ms;
  options.exchange = FLAGS_exchange;
  options.copy_threads = FLAGS_copy_threads;
  options.transfer_workers = FLAGS_transfer_workers;
  options.transfer_checksums = FLAGS_transfer_checksums;
  options.use_gpus = FLAGS_gpus;
  options.gpu_channel_staging_bytes = FLAGS_gpu_channel_staging_mb << 20;
  options.drain_timeout_ms = FLAGS_drain_timeout_ms;
  options.metrics_address = FLAGS_metrics_address;
  options.max_staging_bytes =
      FLAGS_max_staging_mb < 0 ? -1 : FLAGS_max_staging_mb << 20;
  options.device_staging = FLAGS_device_staging;
  options.max_participants = FLAGS_max_participants;
  options.coordinator_address = FLAGS_coordinator;
  options.advertise_address = FLAGS_advertise;
  options.peer_lease_ms = FLAGS_peer_lease_ms;
  options.ucx_nodes = FLAGS_ucx_nodes;
  options.ucx_transports = FLAGS_ucx_transports;
  // Checked by CheckFlags; kept whole while the loop reads it.
  const absl::StatusOr<std::vector<ferry::Rail>> rails =
      ferry::ResolveRails(FLAGS_rails, ferry::Limits::kMaxRails);
  for (const ferry::Rail& r : *rails) {
    options.rails.push_back(r.address);
    options.rail_devices.push_back(r.device);
  }
  options.channel_dead_after_ms = FLAGS_channel_dead_after_ms;
  options.bucket_bytes = FLAGS_bucket_mb << 20;
  options.delta_shadow_bytes = FLAGS_delta_shadow_mb << 20;
  return options;
}

// Run: the Server started (its TCP port logged and written to
// --port_file), then shut down on SIGTERM or SIGINT. Returns the exit
// status: 0 after a shutdown, 1 when the Server cannot start.
int ServeUntilSignalled(const ferry::DaemonOptions& options,
                        const sigset_t& signals) {
  absl::StatusOr<std::unique_ptr<ferry::Server>> server =
      ferry::Server::Start(options);
  if (!server.ok()) {
    LOG(ERROR) << "ferryd cannot start: " << server.status();
    return 1;
  }
  if ((*server)->tcp_port() != 0) {
    LOG(INFO) << "ferryd TCP port " << (*server)->tcp_port();
  }
  if (!FLAGS_port_file.empty()) {
    std::ofstream out(FLAGS_port_file);
    out << (*server)->tcp_port() << "\n";
    if (!out) LOG(ERROR) << "cannot write --port_file " << FLAGS_port_file;
  }

  int received = 0;
  sigwait(&signals, &received);
  LOG(INFO) << "ferryd received signal " << received;
  // A handler stuck in work that ignores its cancellation must not keep
  // the daemon up: past the drain timeout (and gRPC's 2 s of shutdown
  // grace) the process exits anyway, non-zero, saying so.
  const int64_t drain_ms = options.drain_timeout_ms;
  std::thread([drain_ms] {
    std::this_thread::sleep_for(std::chrono::milliseconds(drain_ms + 3000));
    LOG(ERROR) << "ferryd did not stop within --drain_timeout_ms=" << drain_ms
               << " ms (+3 s); exiting without finishing the shutdown";
    std::_Exit(1);
  }).detach();
  (*server)->Shutdown();
  server->reset();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  ParseFlagsAndLog(&argc, &argv);
  const sigset_t signals = BlockShutdownSignals();
  if (absl::Status s = CheckFlags(); !s.ok()) {
    LOG(ERROR) << s.message();
    return 2;
  }
  ferry::SetPlanningThreads(FLAGS_planning_threads);
  return ServeUntilSignalled(OptionsFromFlags(), signals);
}
