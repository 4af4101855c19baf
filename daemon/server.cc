#include "daemon/server.h"

#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/channel_args.h"
#include "common/version.h"
#include "daemon/api/inspection_service.h"
#include "daemon/api/lifecycle_service.h"
#include "daemon/api/registry_service.h"
#include "daemon/api/versions_service.h"
#include "daemon/cluster/forwarding.h"
#include "daemon/cluster/member_link.h"
#include "daemon/cluster/peer_service.h"
#include "daemon/memory/member_memory.h"
#include "daemon/metrics/daemon_metrics.h"
#include "daemon/metrics/metrics_server.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/registry.h"
#include "daemon/security/caller_identity.h"
#include "daemon/security/tls_credentials.h"
#include "daemon/security/unix_socket_listener.h"
#include "daemon/transfer/local_executor.h"
#include "daemon/transfer/peer_box_hasher.h"
#include "daemon/transfer/route_memory.h"
#include "daemon/transfer/route_receiver.h"
#include "daemon/transfer/route_sender.h"
#include "daemon/transfer/transfer_checksums.h"
#include "daemon/versions/version_coordinator.h"
#include "glog/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server_builder.h"
#include "transport/device_memory.h"
#include "transport/local/local_copy_engine.h"
#include "transport/memory_fault_guard.h"
#include "transport/node_gpus.h"
#include "transport/transport.h"

namespace ferry {
namespace {

// Idle gRPC handler threads kept (ServerBuilder's MAX_POLLERS).
constexpr int kMaxIdleHandlerThreads = 32;

// GetHealth's node: the GPUs in use, or why there are none; the rails.
void FillNode(const DeviceMemory& devices,
              const std::vector<std::string>& rails,
              v1::GetHealthResponse* r) {
  for (const std::string& rail : rails) r->add_rails(rail);
  for (const GpuInfo& g : devices.Devices()) {
    v1::DeviceInfo* d = r->add_devices();
    d->mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
    d->mutable_device()->set_cuda_uuid(g.uuid);
    d->mutable_device()->set_cuda_ordinal(g.ordinal);
    d->set_name(g.name);
    d->set_memory_bytes(g.memory_bytes);
  }
  if (absl::Status s = devices.Available(); !s.ok()) {
    r->set_gpu_unavailable_reason(std::string(s.message()));
  }
}

}  // namespace

Server::Server(const DaemonOptions& options) : options_(options) {}

// Checks what the options ask for, installs the memory fault handler and
// loads the TLS credentials of a daemon with a TCP port (null without).
absl::StatusOr<std::shared_ptr<const TlsCredentials>> Server::Prepare(
    const DaemonOptions& options) {
  if (options.socket_path.empty() && options.listen_address.empty()) {
    return absl::InvalidArgumentError(
        "ferryd needs a unix socket or a TCP address to listen on");
  }
  if (!options.coordinator_address.empty() && options.listen_address.empty()) {
    return absl::InvalidArgumentError(
        "a member daemon (--coordinator) needs a TCP address (--listen) "
        "for its peers");
  }
  // After glog's failure handler (main), so a SIGBUS outside a guarded
  // copy still reaches it.
  InstallMemoryFaultHandler();
  std::shared_ptr<const TlsCredentials> tls;
  if (!options.listen_address.empty()) {
    if (!options.tls.any()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ferryd serves TCP (--listen=", options.listen_address,
          ") only with mutual TLS: give --tls_cert, --tls_key and --tls_ca "
          "(deploy/make_certs.sh makes them), or --listen= for no TCP port"));
    }
    absl::StatusOr<std::shared_ptr<const TlsCredentials>> loaded =
        TlsCredentials::Load(options.tls);
    if (!loaded.ok()) return loaded.status();
    tls = *std::move(loaded);
    if (tls->identity() != options.node) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--tls_cert is for '", tls->identity(), "' but this daemon is node '",
          options.node, "': a daemon's certificate names its node (--node)"));
    }
  }
  return tls;
}

// The core objects: callers, registry, metrics, plans, the local copy
// engine and the GPUs, the version coordinator.
void Server::BuildCore(std::unique_ptr<DeviceMemory> devices) {
  const DaemonOptions& options = options_;
  callers_ = std::make_unique<CallerIdentity>();
  registry_ =
      std::make_unique<Registry>(absl::Milliseconds(options.lease_ms),
                                 absl::Milliseconds(options.reaper_interval_ms),
                                 options.max_participants, options.clock);
  metrics_ = std::make_unique<DaemonMetrics>();
  registry_->set_metrics(metrics_.get());
  copy_engine_ = CreateLocalCopyEngine(options.copy_threads);
  NodeGpuOptions gpu_options;
  gpu_options.enabled = options.use_gpus;
  gpu_options.channel_staging_bytes = options.gpu_channel_staging_bytes;
  devices_ =
      devices != nullptr ? std::move(devices) : OpenNodeGpus(gpu_options);
  plans_ = std::make_unique<PlanCache>(
      registry_.get(), metrics_.get(),
      PlanCacheOptions{options.exchange, options.bucket_bytes, options.node,
                       devices_.get()});
  executor_ =
      std::make_unique<LocalExecutor>(copy_engine_.get(), devices_.get());
  VersionCoordinator::Options vc;
  vc.devices = devices_.get();
  vc.ack_timeout = absl::Milliseconds(options.ack_timeout_ms);
  vc.version_timeout = absl::Milliseconds(options.version_timeout_ms);
  vc.relay_wait = absl::Milliseconds(options.relay_wait_ms);
  vc.transfer_workers = options.transfer_workers;
  vc.max_staging_bytes = options.max_staging_bytes;
  vc.device_staging = options.device_staging;
  vc.node = options.node;
  vc.clock = options.clock;
  coordinator_ =
      std::make_unique<VersionCoordinator>(vc, plans_.get(), executor_.get());
  registry_->AddListener(coordinator_.get());
}

// The data path between daemons and the memory work for members: remote
// transfers, member memory, box hashing for checksums; as the coordinator
// or as a member.
void Server::BuildDataPath(const TlsCredentials* tls) {
  const DaemonOptions& options = options_;
  const bool member = !options.coordinator_address.empty();
  RouteOptions rt;
  rt.node = options.node;
  rt.host = options.listen_address.empty() ? "" : AdvertisedHost(options);
  rt.engine = copy_engine_.get();
  rt.devices = devices_.get();
  if (tls != nullptr) rt.credentials = tls->ChannelCredentials();
  rt.listen_host = ListenHost(options.listen_address);
  rt.max_staging_bytes = coordinator_->max_staging_bytes();
  rt.metrics = metrics_.get();
  rt.ucx_nodes = options.ucx_nodes;
  rt.ucx_transports = options.ucx_transports;
  rt.rails = options.rails;
  rt.rail_devices = options.rail_devices;
  rt.channel_dead_after = absl::Milliseconds(options.channel_dead_after_ms);
  rt.delta_shadow_bytes = options.delta_shadow_bytes;
  rt.address_of = [this](const std::string& node) {
    return peer_service_ == nullptr ? std::string()
                                    : peer_service_->AddressOf(node);
  };
  address_of_ = rt.address_of;
  peer_credentials_ = rt.credentials;
  route_memory_ = std::make_unique<RouteMemory>(rt);
  route_sender_ = std::make_unique<RouteSender>(rt, route_memory_.get());
  route_receiver_ = std::make_unique<RouteReceiver>(rt, route_memory_.get(),
                                                    route_sender_.get());
  if (!member) coordinator_->set_remote_executor(route_sender_.get());
  {
    RouteMemory* transfers = route_memory_.get();
    member_memory_ = std::make_unique<MemberMemory>(
        [transfers](const std::string& id) {
          return transfers->LocalMemory(id);
        },
        devices_.get());
  }
  // A copy of a large model on a member takes a while: minutes, not the
  // 10 s of a control call.
  if (!member) {
    coordinator_->offloads().set_remote_memory(
        PeerMemoryCaller(rt.address_of, rt.credentials, absl::Minutes(30)));
  } else {
    RouteMemory* transfers = route_memory_.get();
    member_memory_->set_adapter_hooks(MemberMemory::AdapterHooks{
        [transfers](const std::string& id,
                    std::shared_ptr<const MemoryMap> memory) {
          transfers->AddLocal(id, std::move(memory));
        },
        [transfers](const std::string& id) { transfers->RemoveLocal(id); }});
  }
  box_hasher_ = std::make_unique<PeerBoxHasher>(
      rt.address_of, absl::Minutes(10), rt.credentials);
  TransferChecksums::Options tc;
  tc.enabled = options.transfer_checksums;
  tc.threads = options.copy_threads;
  tc.node = options.node;
  tc.remote = box_hasher_.get();
  checksums_ = std::make_unique<TransferChecksums>(tc);
  if (!member) coordinator_->set_checksums(checksums_.get());
}

// The services clients call: Registry, Versions, Inspection, Lifecycle.
void Server::BuildServices() {
  const DaemonOptions& options = options_;
  const bool member = !options.coordinator_address.empty();
  registry_service_ = std::make_unique<RegistryService>(
      registry_.get(), options.node, devices_.get(), callers_.get(),
      options.coordinator_address);
  {
    VersionCoordinator* coordinator = coordinator_.get();
    registry_service_->set_regions_gate([coordinator](const Participant& p) {
      return coordinator->offloads().RegionsFixed(p);
    });
  }
  versions_service_ =
      std::make_unique<VersionsService>(registry_.get(), coordinator_.get());
  inspection_service_ = std::make_unique<InspectionService>(
      registry_.get(), plans_.get(), coordinator_.get(), options.node);
  inspection_service_->set_checksums(checksums_.get());
  LifecycleService::Options lifecycle;
  lifecycle.node = options.node;
  lifecycle.coordinator_address = options.coordinator_address;
  lifecycle.swap_wait = absl::Milliseconds(options.version_timeout_ms);
  if (!member) {
    lifecycle.remote_memory =
        PeerMemoryCaller(address_of_, peer_credentials_, absl::Seconds(30));
  }
  lifecycle_service_ = std::make_unique<LifecycleService>(
      registry_.get(), plans_.get(), coordinator_.get(), callers_.get(),
      devices_.get(), std::move(lifecycle));
}

// The listeners: the unix socket (returned in `unix_listener`, started
// last), and the gRPC server with this role's services (a member serves
// clients by forwarding to the coordinator) and the Peer service, bound;
// then the address other daemons reach this one at.
absl::Status Server::Listen(
    const TlsCredentials* tls,
    std::unique_ptr<UnixSocketListener>* unix_listener) {
  const DaemonOptions& options = options_;
  const bool member = !options.coordinator_address.empty();
  absl::StatusOr<UnixSocketAccess> access =
      UnixSocketAccess::Parse(options.client_uids);
  if (!access.ok()) return access.status();
  if (!options.socket_path.empty()) {
    absl::StatusOr<std::unique_ptr<UnixSocketListener>> l =
        UnixSocketListener::Listen(options.socket_path, callers_.get(),
                                   *access);
    if (!l.ok()) return l.status();
    *unix_listener = *std::move(l);
  }

  grpc::EnableDefaultHealthCheckService(true);
  grpc::ServerBuilder builder;
  builder.SetMaxReceiveMessageSize(options.max_receive_message_bytes);
  // gRPC's sync server ends a handler thread when over MAX_POLLERS (2) are
  // idle and starts one when none is: under a fleet's bursts of calls, a
  // thread per call (docs/benchmarks.md, "A fleet on one coordinator").
  builder.SetSyncServerOption(grpc::ServerBuilder::SyncServerOption::MAX_POLLERS,
                              kMaxIdleHandlerThreads);
  if (!options.listen_address.empty()) {
    builder.AddListeningPort(options.listen_address, tls->ServerCredentials(),
                             &tcp_port_);
  }
  if (member) {
    // Clients of a member are served by forwarding to the coordinator.
    ForwardingContext forwarding;
    forwarding.node = options.node;
    forwarding.devices = devices_.get();
    forwarding.callers = callers_.get();
    forwarding.route_memory = route_memory_.get();
    forwarding.memory = member_memory_.get();
    forwarding.coordinator = grpc::CreateCustomChannel(
        options.coordinator_address, tls->ChannelCredentials(),
        QuickReconnectArgs());
    MemberLink::Options link;  // the peer address is set once bound
    link.node = options.node;
    link.coordinator_address = options.coordinator_address;
    link.credentials = tls->ChannelCredentials();
    link.rails = options.rails;
    member_link_ = std::make_unique<MemberLink>(link);
    forwarding.link = member_link_.get();
    forwarding_registry_ =
        std::make_unique<ForwardingRegistryService>(forwarding);
    forwarding_versions_ =
        std::make_unique<ForwardingVersionsService>(forwarding);
    forwarding_inspection_ = std::make_unique<ForwardingInspectionService>(
        forwarding, inspection_service_.get());
    builder.RegisterService(forwarding_registry_.get());
    builder.RegisterService(forwarding_versions_.get());
    builder.RegisterService(forwarding_inspection_.get());
  } else {
    builder.RegisterService(registry_service_.get());
    builder.RegisterService(versions_service_.get());
    builder.RegisterService(inspection_service_.get());
  }
  builder.RegisterService(lifecycle_service_.get());
  BuildPeerService();
  builder.RegisterService(peer_service_.get());
  grpc_server_ = builder.BuildAndStart();
  if (grpc_server_ == nullptr ||
      (!options.listen_address.empty() && tcp_port_ == 0)) {
    return absl::UnavailableError(
        absl::StrCat("cannot listen on TCP address ", options.listen_address));
  }
  AdvertisePeerAddress();
  return absl::OkStatus();
}

// The Peer service (membership, the data path's setup calls): bound below
// with the other services.
void Server::BuildPeerService() {
  const DaemonOptions& options = options_;
  const bool member = !options.coordinator_address.empty();
  PeerService::Options peer_options;
  peer_options.node = options.node;
  peer_options.coordinator_address = options.coordinator_address;
  peer_options.lease = absl::Milliseconds(options.peer_lease_ms);
  peer_service_ = std::make_unique<PeerService>(peer_options);
  peer_service_->set_transfers(route_receiver_.get());
  peer_service_->set_member_memory(member_memory_.get());
  if (member) {
    MemberLink* link = member_link_.get();
    peer_service_->set_coordinator_node(
        [link] { return link->coordinator_node(); });
  }
  if (!member) {
    Registry* registry = registry_.get();
    RouteSender* transfers = route_sender_.get();
    peer_service_->set_registry(registry);
    peer_service_->set_on_member_gone(
        [registry, transfers](const std::string& node, const std::string& why) {
          transfers->ForgetNode(node);
          const int n = registry->RemoveNode(node, why);
          if (n > 0) {
            LOG(WARNING) << "removed " << n << " participants of node " << node
                         << ": " << why;
          }
        });
  }
}

// Once bound: the address other daemons reach this one at, and what
// GetHealth reports for this role.
void Server::AdvertisePeerAddress() {
  const DaemonOptions& options = options_;
  if (tcp_port_ != 0) {
    peer_address_ = options.advertise_address.empty()
                        ? absl::StrCat(AdvertisedHost(options), ":", tcp_port_)
                        : options.advertise_address;
  }
  // Known only once bound; set before any member can join (Start below).
  peer_service_->set_peer_address(peer_address_);
  if (!options.coordinator_address.empty()) {
    member_link_->set_peer_address(peer_address_);
  }
  inspection_service_->SetHealthFiller(
      [member = member_link_.get(), peers = peer_service_.get(),
       devices = devices_.get(),
       rails = options.rails](v1::GetHealthResponse* r) {
        if (member != nullptr) {
          r->set_role(v1::DAEMON_ROLE_MEMBER);
          member->FillHealth(r);
        } else {
          peers->FillHealth(r);
        }
        FillNode(*devices, rails, r);
      });
}

// Health, metrics and the threads: the coordinator's workers, the
// registry's reaper, membership, the unix socket's accept loop.
absl::Status Server::StartThreads(
    std::unique_ptr<UnixSocketListener> unix_listener) {
  const DaemonOptions& options = options_;
  coordinator_->set_metrics(metrics_.get());
  metrics_->set_collector([registry = registry_.get(),
                           coordinator = coordinator_.get(),
                           transfers = route_memory_.get()](DaemonMetrics& m) {
    int64_t sources = 0, destinations = 0;
    for (const auto& p : registry->List()) {
      ++(p->role == Role::kSource ? sources : destinations);
    }
    m.participants->Set({"source"}, sources);
    m.participants->Set({"destination"}, destinations);
    // The coordinator's own ranks' staging, and (on a member) what the
    // data path reserved for the ranks it maps.
    m.staging_bytes->Set({"in_use"}, coordinator->StagingBytesInUse() +
                                         transfers->StagingBytesInUse());
    m.staging_bytes->Set({"limit"}, coordinator->max_staging_bytes());
  });
  if (!options.metrics_address.empty()) {
    DaemonMetrics* metrics = metrics_.get();
    absl::StatusOr<std::unique_ptr<MetricsServer>> endpoint =
        MetricsServer::Start(options.metrics_address,
                             [metrics] { return metrics->Render(); });
    if (!endpoint.ok()) return endpoint.status();
    metrics_server_ = *std::move(endpoint);
    LOG(INFO) << "ferryd metrics on http://" << options.metrics_address
              << " (port " << metrics_server_->port() << ")/metrics";
  }
  coordinator_->Start();
  registry_->StartReaper();
  peer_service_->Start();
  if (member_link_ != nullptr) member_link_->Start();
  if (unix_listener != nullptr) {
    unix_listener_ = std::move(unix_listener);
    unix_listener_->Start(grpc_server_.get());
  }
  grpc_server_->GetHealthCheckService()->SetServingStatus(true);
  LOG(INFO) << "ferryd " << kDaemonVersion << " on node " << options.node
            << " serving"
            << (options.socket_path.empty()
                    ? ""
                    : absl::StrCat(" unix:", options.socket_path))
            << (tcp_port_ ? absl::StrCat(" tcp port ", tcp_port_) : "");
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Server>> Server::Start(
    const DaemonOptions& options, std::unique_ptr<DeviceMemory> devices) {
  absl::StatusOr<std::shared_ptr<const TlsCredentials>> tls = Prepare(options);
  if (!tls.ok()) return tls.status();
  std::unique_ptr<Server> s(new Server(options));
  s->BuildCore(std::move(devices));
  s->BuildDataPath(tls->get());
  s->BuildServices();
  std::unique_ptr<UnixSocketListener> unix_listener;
  absl::Status listening = s->Listen(tls->get(), &unix_listener);
  if (!listening.ok()) return listening;
  absl::Status started = s->StartThreads(std::move(unix_listener));
  if (!started.ok()) return started;
  return s;
}

Server::~Server() { Shutdown(); }

int Server::metrics_port() const {
  return metrics_server_ == nullptr ? 0 : metrics_server_->port();
}

void Server::Shutdown() {
  if (shut_down_) return;
  shut_down_ = true;
  LOG(INFO) << "ferryd shutting down: draining versions in flight";
  metrics_server_.reset();
  if (grpc_server_ != nullptr) {
    grpc_server_->GetHealthCheckService()->SetServingStatus(false);
  }
  // Versions in flight keep their connections (acks still arrive); new
  // versions are refused; after the drain, Subscribe streams end.
  if (coordinator_ != nullptr) {
    coordinator_->Shutdown(absl::Milliseconds(options_.drain_timeout_ms));
  }
  if (member_link_ != nullptr) member_link_->Stop();  // leaves
  if (peer_service_ != nullptr) peer_service_->Stop();
  if (unix_listener_ != nullptr) unix_listener_->Stop();
  if (grpc_server_ != nullptr) {
    grpc_server_->Shutdown(std::chrono::system_clock::now() +
                           std::chrono::seconds(2));
    grpc_server_->Wait();
  }
  if (registry_ != nullptr) registry_->StopReaper();
  LOG(INFO) << "ferryd stopped";
}

}  // namespace ferry
