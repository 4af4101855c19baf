#include "daemon/peer_service.h"

#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/daemon_options.h"
#include "daemon/status_util.h"
#include "glog/logging.h"

namespace ferry {
namespace {

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
    grpc::ServerContext*, const v1::JoinCoordinatorRequest* request,
    v1::JoinCoordinatorResponse* response) {
  if (!is_coordinator()) return NotCoordinator();
  if (request->node().empty() || request->peer_address().empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError(
        "JoinCoordinator: node and peer_address are required"));
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
  if (it != members_.end() && !it->second.lost) {
    LOG(INFO) << "node " << request->node() << " replaces its earlier "
              << "membership";
  }
  Member m;
  m.info.set_node(request->node());
  m.info.set_peer_address(request->peer_address());
  *m.info.mutable_devices() = request->devices();
  m.info.set_joined_unix_ms(absl::ToUnixMillis(absl::Now()));
  m.token = NewToken(next_token_++);
  m.last_heartbeat = absl::Now();
  members_[request->node()] = m;
  ++epoch_;
  LOG(INFO) << "node " << request->node() << " joined from "
            << request->peer_address() << " (membership epoch " << epoch_
            << ")";
  response->mutable_handle()->set_node(request->node());
  response->mutable_handle()->set_token(m.token);
  response->set_lease_duration_ms(absl::ToInt64Milliseconds(options_.lease));
  response->set_membership_epoch(epoch_);
  ListMembersLocked(response->mutable_members());
  return grpc::Status::OK;
}

grpc::Status PeerService::LeaveCoordinator(
    grpc::ServerContext*, const v1::LeaveCoordinatorRequest* request,
    v1::LeaveCoordinatorResponse*) {
  if (!is_coordinator()) return NotCoordinator();
  absl::MutexLock lock(&mu_);
  Member* m = nullptr;
  grpc::Status s = AuthenticateLocked(request->handle(), &m);
  if (!s.ok()) return s;
  members_.erase(request->handle().node());
  ++epoch_;
  LOG(INFO) << "node " << request->handle().node() << " left (membership "
            << "epoch " << epoch_ << ")";
  return grpc::Status::OK;
}

grpc::Status PeerService::PeerHeartbeat(
    grpc::ServerContext*, const v1::PeerHeartbeatRequest* request,
    v1::PeerHeartbeatResponse* response) {
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

grpc::Status PeerService::OpenChannel(grpc::ServerContext*,
                                      const v1::OpenChannelRequest*,
                                      v1::OpenChannelResponse*) {
  return ToGrpcStatus(absl::UnimplementedError(
      "Peer.OpenChannel is not built yet: the cross-node data path "
      "(docs/architecture.md, \"Several nodes\") is designed, not built"));
}

void PeerService::FillHealth(v1::GetHealthResponse* response) const {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  for (const auto& [node, m] : members_) {
    v1::PeerHealth* p = response->add_peers();
    p->set_node(node);
    p->set_peer_address(m.info.peer_address());
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
