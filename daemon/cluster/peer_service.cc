#include "daemon/cluster/peer_service.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "common/version.h"
#include "core/limits.h"
#include "daemon/memory/member_memory.h"
#include "daemon/registry/registration_parser.h"
#include "daemon/registry/registry.h"
#include "daemon/security/tls_credentials.h"
#include "daemon/transfer/route_receiver.h"
#include "daemon/transfer/transfer_checksums.h"
#include "glog/logging.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {
namespace {

// A rail is an address (IPv6 text is at most 45 bytes).
constexpr size_t kMaxRailBytes = 64;

std::string NewToken(uint64_t serial) {
  std::random_device rd;
  return absl::StrFormat("%016x%08x%08x", serial, rd(), rd());
}

}  // namespace

PeerService::PeerService(const Options& options) : options_(options) {}

PeerService::~PeerService() { Stop(); }

void PeerService::Start() {
  sweeper_ = std::thread([this] { SweepLoop(); });
}

void PeerService::Stop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    changed_.SignalAll();
  }
  if (sweeper_.joinable()) sweeper_.join();
}

absl::StatusOr<std::string> PeerService::PeerIdentity(
    const grpc::ServerContext& context) {
  std::string identity = CertificateIdentity(context);
  if (identity.empty()) {
    return absl::PermissionDeniedError(
        "the Peer service is only for peer daemons, over mutual TLS on the "
        "TCP port; it is not served on the unix socket");
  }
  return identity;
}

grpc::Status PeerService::ActsAs(const grpc::ServerContext& context,
                                 const std::string& claimed,
                                 const char* field) {
  absl::StatusOr<std::string> identity = PeerIdentity(context);
  if (!identity.ok()) return ToGrpcStatus(identity.status());
  if (claimed != *identity) {
    return ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
        field, " is ", Quote(claimed), ", but the caller's "
        "certificate is for node ", Quote(*identity),
        ": a daemon acts only as the node its certificate names")));
  }
  return grpc::Status::OK;
}

grpc::Status PeerService::NotCoordinator() const {
  return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
      "node ", options_.node, " is not the coordinator; the coordinator is ",
      options_.coordinator_address)));
}

void PeerService::ListMembersLocked(
    google::protobuf::RepeatedPtrField<v1::PeerMember>* out) const {
  v1::PeerMember* self = out->Add();
  self->set_node(options_.node);
  self->set_peer_address(peer_address_);
  self->set_joined_unix_ms(absl::ToUnixMillis(started_));
  for (const auto& [node, m] : members_) {
    if (!m.lost) *out->Add() = m.info;
  }
}

grpc::Status PeerService::AuthenticateLocked(const v1::PeerHandle& handle,
                                             Member** member) {
  if (handle.node().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError("handle.node is required"));
  }
  auto it = members_.find(handle.node());
  if (it == members_.end() || it->second.lost) {
    return ToGrpcStatus(absl::NotFoundError(absl::StrCat(
        "node ", handle.node(),
        " is not a member (its lease ran out, or it left): join again")));
  }
  if (it->second.token != handle.token()) {
    return ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
        "wrong membership token for node ", handle.node())));
  }
  *member = &it->second;
  return grpc::Status::OK;
}

grpc::Status PeerService::JoinCoordinator(
    grpc::ServerContext* context, const v1::JoinCoordinatorRequest* request,
    v1::JoinCoordinatorResponse* response) {
  if (grpc::Status a = ActsAs(*context, request->node(), "node"); !a.ok()) {
    return a;
  }
  if (!is_coordinator()) return NotCoordinator();
  if (request->node().empty() || request->peer_address().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        "JoinCoordinator: node and peer_address are required"));
  }
  if (request->rails_size() > static_cast<int>(Limits::kMaxRails)) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "JoinCoordinator: node ", Quote(request->node()), " names ",
        request->rails_size(), " rails (at most ", Limits::kMaxRails, ")")));
  }
  for (const std::string& rail : request->rails()) {
    if (rail.empty() || rail.size() > kMaxRailBytes) {
      return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
          "JoinCoordinator: node ", Quote(request->node()), ": rail ",
          Quote(rail), " must be an address of 1 to ", kMaxRailBytes,
          " bytes")));
    }
  }
  if (request->node() == options_.node) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "JoinCoordinator: node ", request->node(),
        " is the coordinator's own name; every daemon needs its own --node")));
  }
  if (!request->daemon_version().empty() &&
      request->daemon_version() != kDaemonVersion) {
    return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
        "JoinCoordinator: member ferryd ", request->daemon_version(),
        " does not speak coordinator ferryd ", kDaemonVersion,
        "'s wire protocol")));
  }
  absl::MutexLock lock(&mu_);
  auto it = members_.find(request->node());
  if (it != members_.end() && !it->second.lost &&
      !request->replace_existing()) {
    return ToGrpcStatus(absl::AlreadyExistsError(absl::StrCat(
        "node ", request->node(), " is a member with a live lease (from ",
        it->second.info.peer_address(),
        "); pass replace_existing to take it over")));
  }
  const bool had_earlier = it != members_.end();
  if (it != members_.end() && !it->second.lost) {
    LOG(INFO) << "node " << request->node() << " replaces its earlier "
              << "membership";
  }
  if (had_earlier && on_member_gone_) {
    // Its participants are deregistered first (the old daemon's clients;
    // they register again through the new one). No lock held for it.
    const std::string earlier_token = it->second.token;
    mu_.Unlock();
    on_member_gone_(request->node(),
                    "its node's daemon rejoined (replace_existing)");
    mu_.Lock();
    // Another join of the same node may have won while the lock was
    // released: then this one must not overwrite it (its caller would
    // hold a token the coordinator no longer knows). One winner, and the
    // other is told to join again.
    auto now = members_.find(request->node());
    if (now == members_.end() || now->second.token != earlier_token) {
      return ToGrpcStatus(absl::AbortedError(absl::StrCat(
          "JoinCoordinator: another join of node ", request->node(),
          " completed meanwhile; join again")));
    }
  }
  Member m;
  m.info.set_node(request->node());
  m.info.set_peer_address(request->peer_address());
  *m.info.mutable_devices() = request->devices();
  *m.info.mutable_rails() = request->rails();
  m.info.set_joined_unix_ms(absl::ToUnixMillis(absl::Now()));
  m.token = NewToken(next_token_++);
  m.last_heartbeat = absl::Now();
  members_[request->node()] = m;
  ++epoch_;
  LOG(INFO) << "node " << request->node() << " joined from "
            << request->peer_address() << " (membership epoch " << epoch_
            << (request->rails().empty()
                    ? std::string()
                    : absl::StrCat("; rails ",
                                   absl::StrJoin(request->rails(), ", ")))
            << ")";
  response->mutable_handle()->set_node(request->node());
  response->mutable_handle()->set_token(m.token);
  response->set_lease_duration_ms(absl::ToInt64Milliseconds(options_.lease));
  response->set_membership_epoch(epoch_);
  ListMembersLocked(response->mutable_members());
  return grpc::Status::OK;
}

grpc::Status PeerService::LeaveCoordinator(
    grpc::ServerContext* context, const v1::LeaveCoordinatorRequest* request,
    v1::LeaveCoordinatorResponse*) {
  if (grpc::Status a = ActsAs(*context, request->handle().node(),
                              "handle.node");
      !a.ok()) {
    return a;
  }
  if (!is_coordinator()) return NotCoordinator();
  absl::MutexLock lock(&mu_);
  Member* m = nullptr;
  grpc::Status s = AuthenticateLocked(request->handle(), &m);
  if (!s.ok()) return s;
  members_.erase(request->handle().node());
  ++epoch_;
  LOG(INFO) << "node " << request->handle().node() << " left (membership "
            << "epoch " << epoch_ << ")";
  if (on_member_gone_) {
    const std::string node = request->handle().node();
    mu_.Unlock();
    on_member_gone_(node, "its node's daemon left");
    mu_.Lock();
  }
  return grpc::Status::OK;
}

grpc::Status PeerService::PeerHeartbeat(
    grpc::ServerContext* context, const v1::PeerHeartbeatRequest* request,
    v1::PeerHeartbeatResponse* response) {
  if (grpc::Status a = ActsAs(*context, request->handle().node(),
                              "handle.node");
      !a.ok()) {
    return a;
  }
  if (!is_coordinator()) return NotCoordinator();
  absl::MutexLock lock(&mu_);
  Member* m = nullptr;
  grpc::Status s = AuthenticateLocked(request->handle(), &m);
  if (!s.ok()) return s;
  m->last_heartbeat = absl::Now();
  response->set_lease_duration_ms(absl::ToInt64Milliseconds(options_.lease));
  response->set_membership_epoch(epoch_);
  if (epoch_ > request->known_membership_epoch()) {
    ListMembersLocked(response->mutable_members());
  }
  return grpc::Status::OK;
}

grpc::Status PeerService::OpenChannel(grpc::ServerContext* context,
                                      const v1::OpenChannelRequest* request,
                                      v1::OpenChannelResponse* response) {
  if (grpc::Status a = ActsAs(*context, request->caller_node(),
                              "caller_node");
      !a.ok()) {
    return a;
  }
  if (transfers_ == nullptr) {
    return ToGrpcStatus(absl::UnavailableError("no data path on this daemon"));
  }
  if (is_coordinator()) {
    absl::MutexLock lock(&mu_);
    auto it = members_.find(request->caller_node());
    if (it == members_.end() || it->second.lost) {
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "OpenChannel: ", request->caller_node(), " is not a member")));
    }
  }
  return ToGrpcStatus(transfers_->OpenChannel(*request, response));
}

grpc::Status PeerService::RunTransfer(grpc::ServerContext* context,
                                      const v1::RunTransferRequest* request,
                                      v1::RunTransferResponse* response) {
  absl::StatusOr<std::string> caller = PeerIdentity(*context);
  if (!caller.ok()) return ToGrpcStatus(caller.status());
  if (transfers_ == nullptr) {
    return ToGrpcStatus(absl::UnavailableError("no data path on this daemon"));
  }
  if (request->role() == "send" || request->role() == "local") {
    // Work that makes this daemon connect out and copy comes only from
    // the coordinator it joined (it names the addresses).
    const std::string rpc = absl::StrCat("RunTransfer role ", request->role());
    if (absl::Status s = FromJoinedCoordinator(*context, rpc.c_str(), transfers_);
        !s.ok()) {
      return ToGrpcStatus(s);
    }
  } else if (is_coordinator()) {
    absl::MutexLock lock(&mu_);
    auto it = members_.find(*caller);
    if (it == members_.end() || it->second.lost) {
      return ToGrpcStatus(absl::PermissionDeniedError(absl::StrCat(
          "RunTransfer: ", Quote(*caller), " is not a member")));
    }
  }
  return ToGrpcStatus(transfers_->RunTransfer(
      *request, [context] { return context->IsCancelled(); }, response));
}

absl::Status PeerService::FromJoinedCoordinator(
    const grpc::ServerContext& context, const char* rpc,
    const void* needs) const {
  if (needs == nullptr) return absl::UnavailableError("no data path here");
  absl::StatusOr<std::string> caller = PeerIdentity(context);
  if (!caller.ok()) return caller.status();
  const std::string coordinator =
      is_coordinator() || !coordinator_node_ ? "" : coordinator_node_();
  if (coordinator.empty() || *caller != coordinator) {
    return absl::PermissionDeniedError(absl::StrCat(
        rpc, " is taken only from the coordinator this daemon joined",
        is_coordinator() ? " (this daemon is the coordinator)" : "",
        "; the caller is ", Quote(*caller)));
  }
  return absl::OkStatus();
}

grpc::Status PeerService::HashBoxes(grpc::ServerContext* context,
                                    const v1::HashBoxesRequest* request,
                                    v1::HashBoxesResponse* response) {
  // Hashes of small boxes would tell the caller the values in registered
  // memory: only the coordinator this member joined may ask.
  if (absl::Status s = FromJoinedCoordinator(*context, "HashBoxes", transfers_);
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = CheckHashBoxesLimits(*request); !s.ok()) {
    return ToGrpcStatus(s);
  }
  RouteReceiver* transfers = transfers_;
  return ToGrpcStatus(HashMappedBoxes(
      *request,
      [transfers](const std::string& id) { return transfers->LocalMemory(id); },
      /*threads=*/0, response));
}

grpc::Status PeerService::BlockAmax(grpc::ServerContext* context,
                                    const v1::BlockAmaxRequest* request,
                                    v1::BlockAmaxResponse* response) {
  // Block maxima reveal registered memory's values: the coordinator only.
  if (absl::Status s = FromJoinedCoordinator(*context, "BlockAmax", transfers_);
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<v1::BlockAmaxResponse> answer =
      transfers_->BlockAmax(*request);
  if (!answer.ok()) return ToGrpcStatus(answer.status());
  *response = *std::move(answer);
  return grpc::Status::OK;
}

grpc::Status PeerService::ManageMemory(grpc::ServerContext* context,
                                       const v1::ManageMemoryRequest* request,
                                       v1::ManageMemoryResponse* response) {
  // It moves and frees registered memory: only the coordinator this member
  // joined, which runs the offload protocol, may ask.
  if (absl::Status s =
          FromJoinedCoordinator(*context, "ManageMemory", member_memory_);
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  if (absl::Status s = CheckManageMemoryLimits(*request); !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<v1::ManageMemoryResponse> answer =
      member_memory_->Manage(*request);
  if (!answer.ok()) return ToGrpcStatus(answer.status());
  *response = *std::move(answer);
  return grpc::Status::OK;
}

grpc::Status PeerService::ForwardRegistration(
    grpc::ServerContext* context, const v1::ForwardRegistrationRequest* request,
    v1::ForwardRegistrationResponse* response) {
  if (grpc::Status a = ActsAs(*context, request->member().node(),
                              "member.node");
      !a.ok()) {
    return a;
  }
  if (!is_coordinator() || registry_ == nullptr) return NotCoordinator();
  std::string node;
  {
    absl::MutexLock lock(&mu_);
    Member* m = nullptr;
    grpc::Status s = AuthenticateLocked(request->member(), &m);
    // A member this coordinator does not know now (it restarted, or the
    // member's lease ran out) joins again within a third of a lease: to
    // the rank registering through it, that is a daemon not ready yet,
    // which it retries (UNAVAILABLE), not a refusal.
    if (s.error_code() == grpc::StatusCode::NOT_FOUND ||
        s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      return ToGrpcStatus(absl::UnavailableError(absl::StrCat(
          s.error_message(), "; node ", request->member().node(),
          " is joining its coordinator again: retry")));
    }
    if (!s.ok()) return s;
    node = m->info.node();
  }
  absl::StatusOr<std::unique_ptr<Participant>> parsed;
  bool replace = false;
  if (request->has_source() && request->source().has_source()) {
    parsed = ParseSourceRegistration(request->source().source(), node,
                                     MapOptions{/*map_memory=*/false},
                                     registry_->declaration_cache());
    replace = request->source().replace_existing();
  } else if (request->has_destination() &&
             request->destination().has_destination()) {
    parsed = ParseDestinationRegistration(
        request->destination().destination(), node,
        MapOptions{/*map_memory=*/false});
    replace = request->destination().replace_existing();
  } else {
    return ToGrpcStatus(absl::InvalidArgumentError(
        "ForwardRegistration: a source or destination registration is "
        "required"));
  }
  if (!parsed.ok()) return ToGrpcStatus(parsed.status());
  absl::StatusOr<std::shared_ptr<const Participant>> added =
      registry_->Add(*std::move(parsed), replace);
  if (!added.ok()) return ToGrpcStatus(added.status());
  response->mutable_handle()->set_participant_id((*added)->id);
  response->mutable_handle()->set_token((*added)->token);
  response->set_lease_duration_ms(
      absl::ToInt64Milliseconds(registry_->lease()));
  return grpc::Status::OK;
}

std::string PeerService::AddressOf(const std::string& node) const {
  absl::MutexLock lock(&mu_);
  if (node == options_.node) return peer_address_;  // this daemon
  auto it = members_.find(node);
  if (it == members_.end() || it->second.lost) return "";
  return it->second.info.peer_address();
}

void PeerService::FillHealth(v1::GetHealthResponse* response) const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (const auto& [node, m] : members_) {
    v1::PeerHealth* p = response->add_peers();
    p->set_node(node);
    p->set_peer_address(m.info.peer_address());
    *p->mutable_rails() = m.info.rails();
    p->set_reachable(!m.lost);
    p->set_last_heartbeat_age_ms(
        absl::ToInt64Milliseconds(now - m.last_heartbeat));
    if (m.lost) {
      response->add_problems(absl::StrCat(
          "peer ", node, " missed heartbeats for ",
          absl::ToInt64Milliseconds(now - m.last_heartbeat),
          " ms (lease ran out)"));
    }
  }
}

int64_t PeerService::membership_epoch() const {
  absl::MutexLock lock(&mu_);
  return epoch_;
}

void PeerService::ExpireLeases() {
  std::vector<std::string> gone;
  {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (auto& [node, m] : members_) {
    if (m.lost || now - m.last_heartbeat <= options_.lease) continue;
    m.lost = true;
    m.lost_at = now;
    ++epoch_;
    LOG(WARNING) << "node " << node << ": lease ran out after "
                 << absl::ToInt64Milliseconds(now - m.last_heartbeat)
                 << " ms without PeerHeartbeat; treated as having left "
                 << "(membership epoch " << epoch_ << ")";
    gone.push_back(node);
  }
  }
  if (on_member_gone_) {
    for (const std::string& node : gone) {
      on_member_gone_(node, "its node's daemon lost its membership lease");
    }
  }
}

void PeerService::SweepLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      changed_.WaitWithTimeout(&mu_, options_.sweep_interval);
      if (stopping_) return;
    }
    ExpireLeases();
  }
}

}  // namespace ferry
