// DaemonOptions: everything ferryd is configured with, in one struct that
// main.cc fills from flags and tests fill by hand.
#ifndef FERRY_DAEMON_DAEMON_OPTIONS_H_
#define FERRY_DAEMON_DAEMON_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "common/clock.h"
#include "core/limits.h"
#include "daemon/security/tls_credentials.h"

namespace ferry {

struct DaemonOptions {
  // This daemon's node name (GetHealth, participants' `node` check).
  std::string node = "localhost";
  // Unix socket for local clients; its directory is created mode 0700 and
  // the socket is mode 0600. Empty: no unix socket.
  std::string socket_path;
  // Who besides this daemon's uid and root may connect to the socket:
  // "" none, "all", or a comma-separated list of uids. Each caller's
  // memory is mapped only with that caller's rights (memory_map.h).
  std::string client_uids;
  // TCP address for peers and remote ferryctl, e.g. "127.0.0.1:0" (0 picks
  // a free port; Server::tcp_port() says which). Empty: no TCP port.
  // Served only with mutual TLS (`tls`), and so are calls to other daemons.
  std::string listen_address;
  // This daemon's certificate, key and the cluster CA (tls_credentials.h);
  // required with listen_address.
  TlsFiles tls;
  // How long a registration lives without a Heartbeat.
  int64_t lease_ms = 10000;
  // How long a destination rank has to ack an event (PREPARE, PAUSE, APPLY).
  int64_t ack_timeout_ms = 30000;
  // How long a version may run after its first CommitVersion before the
  // instances still unsettled are aborted.
  int64_t version_timeout_ms = 120000;
  // How long a paused replica waits for the replica it relays from (or
  // the partner it exchanges with) to finish pausing before it reads the
  // trainer instead.
  int64_t relay_wait_ms = 2000;
  // Pairs of replicas that read the trainer alike exchange the busiest
  // senders' buckets (core/exchange.h). Off by default: it pays where the
  // trainer's NICs are the busiest ports and a route between two nodes
  // can use more than one NIC (docs/benchmarks.md).
  bool exchange = false;
  // Largest bucket of a plan (a staging buffer between nodes). Tests make
  // it small to get many buckets out of a small model.
  int64_t bucket_bytes = int64_t{64} << 20;
  // Use this node's GPUs for clients' CUDA IPC regions (when ferryd is
  // built with CUDA and a GPU is there). False: host memory only.
  bool use_gpus = true;
  // Each of the two device staging slots of an NCCL channel to another
  // daemon (GPU memory between nodes).
  int64_t gpu_channel_staging_bytes = int64_t{64} << 20;
  // Threads of the local copy engine (0: min(4, cores)); as many hash the
  // sources' checksums while it copies.
  int copy_threads = 0;
  // Instances whose transfers run at once (VersionCoordinator's transfer
  // workers); 1: one instance at a time.
  int transfer_workers = 8;
  // Hash every delivered box where it leaves the source and keep the
  // checksums of each instance's committed version, for
  // Inspection.VerifyInstance (daemon/transfer/transfer_checksums.h). Off by
  // default: on the host path it costs a read of every source byte per
  // version (docs/benchmarks.md); GPU memory is never hashed.
  bool transfer_checksums = false;
  // How often the reaper looks for expired leases and exited pids.
  int64_t reaper_interval_ms = 100;
  // Largest gRPC message the daemon receives (large registrations); a
  // larger one is RESOURCE_EXHAUSTED (docs/api.md, "Limits").
  int max_receive_message_bytes = 256 << 20;
  // Staging all instances' fallback tensors may hold together, bytes; an
  // instance that would need more aborts its version (RESOURCE_EXHAUSTED
  // in its abort_reason). Negative: half the size of /dev/shm.
  int64_t max_staging_bytes = -1;
  // GPU ranks that ask for device staging get their fallback tensors in
  // GPU memory on their own GPU (staging_area.h); false: host staging for
  // every rank.
  bool device_staging = true;
  // Participants this daemon holds at once (registrations past it are
  // RESOURCE_EXHAUSTED); at most Limits::kMaxParticipantsPerDaemon.
  int64_t max_participants = Limits::kMaxParticipantsPerDaemon;
  // Where leases and ack/version deadlines read the time (common/clock.h);
  // not owned. Null: the real clock. Tests pass a ManualClock.
  const Clock* clock = nullptr;
  // On shutdown, how long in-flight versions may take to settle.
  int64_t drain_timeout_ms = 10000;
  // Serve Prometheus metrics over HTTP on this "HOST:PORT" (port 0: any
  // free one). Empty: no metrics endpoint.
  std::string metrics_address;
  // Several nodes (docs/architecture.md): empty, this daemon is the
  // coordinator; else the coordinator's "host:port", and this daemon joins
  // it as a member (needs listen_address).
  std::string coordinator_address;
  // "host:port" other daemons reach this one's Peer service at. Empty: the
  // listen address's host (the hostname for a wildcard) and the bound port.
  std::string advertise_address;
  // Coordinator: how long a member lives without PeerHeartbeat.
  int64_t peer_lease_ms = 10000;
  // Host memory this daemon sends to these nodes goes over UCX instead of
  // TCP (transport/ucx/): "" none, "*" every node, or a comma-separated
  // list of node names. The receiving daemon follows the sender's choice.
  std::string ucx_nodes;
  // UCX_TLS of this daemon's UCX channels ("" UCX's default, or UCX_TLS
  // from the environment); docs/operations.md, "UCX between nodes".
  std::string ucx_transports;
  // Rails (docs/operations.md, "Rails"): the addresses of this host, one
  // per NIC, its TCP channels to other nodes bind (--rails, resolved);
  // empty: one rail, the kernel's choice. At most Limits::kMaxRails.
  std::vector<std::string> rails;
  // The interface of each rail (UCX channels use it: UCX_NET_DEVICES).
  std::vector<std::string> rail_devices;
  // A TCP channel between daemons unanswered this long fails
  // (TCP_USER_TIMEOUT and keepalive); 0: the kernel's defaults.
  int64_t channel_dead_after_ms = 10000;
  // Delta versions: host memory for shadows of the sources this daemon's
  // routes to other nodes read (daemon/transfer/delta_shadows.h); 0: off.
  int64_t delta_shadow_bytes = 0;
};

// The host other daemons reach this one at: --advertise's host, else
// --listen's (the hostname for a wildcard).
std::string AdvertisedHost(const DaemonOptions& options);
// The host part of --listen, which the channel listeners bind too ("" for
// a wildcard: every address).
std::string ListenHost(const std::string& listen_address);

}  // namespace ferry

#endif  // FERRY_DAEMON_DAEMON_OPTIONS_H_
