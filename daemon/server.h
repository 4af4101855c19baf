// Server: ferryd assembled. Builds the components, wires them together and
// serves them over gRPC on the unix socket (local clients) and on TCP
// (peers, remote ferryctl).
//
//   Registry  <- RegistryService              (registration.proto)
//      |  listener: removals abort in-flight work
//   PlanCache <- VersionCoordinator <- VersionsService   (version.proto)
//      |              |  transfer workers
//      |          LocalExecutor -> CopyEngine (transport/local)
//      |                        -> DeviceMemory::Engine (GPUs, cuda/)
//   InspectionService (inspection.proto), LifecycleService (lifecycle.proto),
//   grpc.health.v1.Health
//   PeerService (peer.proto): membership, on the coordinator
//   MemberLink: joins and heartbeats the coordinator, on a member
//   RouteSender, RouteReceiver (over RouteMemory): the cross-node data
//   path (Peer.OpenChannel, Peer.RunTransfer; the coordinator's transfer
//   workers for instances on members)
//   Forwarding*Service (forwarding.h): on a member, the client-facing
//   Registry, Versions and Inspection services, forwarding to the
//   coordinator
//
// On one node the daemon is its own coordinator. With
// options.coordinator_address it is a member (docs/architecture.md,
// "Several nodes"). Owner: main.cc or a test.
// Threading: Start and Shutdown from one thread; the components are
// thread-safe.
#ifndef FERRY_DAEMON_SERVER_H_
#define FERRY_DAEMON_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/daemon_options.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server.h"
#include "transport/device_memory.h"

namespace ferry {

class CallerIdentity;
class TlsCredentials;
class CopyEngine;
class LocalExecutor;
class InspectionService;
class LifecycleService;
class MemberLink;
class MemberMemory;
class PeerBoxHasher;
class PeerService;
class DaemonMetrics;
class MetricsServer;
class PlanCache;
class Registry;
class RegistryService;
class ForwardingInspectionService;
class ForwardingRegistryService;
class ForwardingVersionsService;
class RouteMemory;
class RouteReceiver;
class RouteSender;
class TransferChecksums;
class UnixSocketListener;
class VersionCoordinator;
class VersionsService;

class Server {
 public:
  // Builds everything and starts serving. `devices`: the GPU memory
  // backend (tests inject one); null: OpenNodeGpus with the options' GPU
  // settings.
  // Errors: the socket or the TCP address cannot be bound.
  static absl::StatusOr<std::unique_ptr<Server>> Start(
      const DaemonOptions& options,
      std::unique_ptr<DeviceMemory> devices = nullptr);
  ~Server();  // Shutdown()
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Stops taking new versions and connections, lets versions in flight
  // settle (up to options.drain_timeout_ms), ends Subscribe streams
  // (UNAVAILABLE) and stops serving. Idempotent.
  void Shutdown();

  // The bound TCP port (0: no TCP listener).
  int tcp_port() const { return tcp_port_; }
  // The metrics endpoint's port (0: none; options.metrics_address).
  int metrics_port() const;
  DaemonMetrics* metrics() { return metrics_.get(); }
  const std::string& socket_path() const { return options_.socket_path; }
  Registry* registry() { return registry_.get(); }
  // "host:port" other daemons reach this one at (empty: no TCP port).
  const std::string& peer_address() const { return peer_address_; }

 private:
  explicit Server(const DaemonOptions& options);

  // Start's steps, in order (server.cc says what each builds).
  static absl::StatusOr<std::shared_ptr<const TlsCredentials>> Prepare(
      const DaemonOptions& options);
  void BuildCore(std::unique_ptr<DeviceMemory> devices);
  void BuildDataPath(const TlsCredentials* tls);
  void BuildServices();
  absl::Status Listen(const TlsCredentials* tls,
                      std::unique_ptr<UnixSocketListener>* unix_listener);
  void BuildPeerService();
  void AdvertisePeerAddress();
  absl::Status StartThreads(std::unique_ptr<UnixSocketListener> unix_listener);

  const DaemonOptions options_;
  int tcp_port_ = 0;
  std::string peer_address_;
  bool shut_down_ = false;
  // First, so destroyed last: participants' memory maps hold its mappings.
  std::unique_ptr<DeviceMemory> devices_;
  // Who is at the other end of each unix connection (listener, services).
  std::unique_ptr<CallerIdentity> callers_;
  // Before everything that counts into it; its endpoint stops first.
  std::unique_ptr<DaemonMetrics> metrics_;
  std::unique_ptr<Registry> registry_;
  std::unique_ptr<PlanCache> plans_;
  std::unique_ptr<CopyEngine> copy_engine_;
  std::unique_ptr<LocalExecutor> executor_;
  // Before the coordinator, which uses them until it is destroyed.
  std::unique_ptr<PeerBoxHasher> box_hasher_;
  std::unique_ptr<TransferChecksums> checksums_;
  std::unique_ptr<VersionCoordinator> coordinator_;
  std::unique_ptr<RegistryService> registry_service_;
  std::unique_ptr<VersionsService> versions_service_;
  std::unique_ptr<InspectionService> inspection_service_;
  std::unique_ptr<LifecycleService> lifecycle_service_;
  std::unique_ptr<PeerService> peer_service_;
  std::unique_ptr<MemberLink> member_link_;
  std::unique_ptr<RouteMemory> route_memory_;
  std::unique_ptr<RouteSender> route_sender_;
  std::unique_ptr<RouteReceiver> route_receiver_;
  // Offload's host copies of ranks this daemon maps for a coordinator.
  std::unique_ptr<MemberMemory> member_memory_;
  std::unique_ptr<ForwardingRegistryService> forwarding_registry_;
  std::unique_ptr<ForwardingVersionsService> forwarding_versions_;
  std::unique_ptr<ForwardingInspectionService> forwarding_inspection_;
  std::unique_ptr<grpc::Server> grpc_server_;
  std::unique_ptr<UnixSocketListener> unix_listener_;
  std::unique_ptr<MetricsServer> metrics_server_;
  // How this daemon reaches another's Peer service (BuildDataPath).
  std::function<std::string(const std::string&)> address_of_;
  std::shared_ptr<grpc::ChannelCredentials> peer_credentials_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_SERVER_H_
