#include "daemon/cluster/member_link.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/channel_args.h"
#include "common/version.h"
#include "glog/logging.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"

namespace ferry {
namespace {

std::chrono::system_clock::time_point DeadlineIn(absl::Duration d) {
  return absl::ToChronoTime(absl::Now() + d);
}

}  // namespace

MemberLink::MemberLink(const Options& options)
    : options_(options),
      // Rejoins a restarted coordinator within about a second.
      stub_(v1::Peer::NewStub(grpc::CreateCustomChannel(
          options.coordinator_address, options.credentials,
          QuickReconnectArgs()))) {
  last_answer_ = absl::Now();
}

MemberLink::~MemberLink() { Stop(); }

void MemberLink::Start() {
  thread_ = std::thread([this] { Loop(); });
}

void MemberLink::Stop() {
  v1::PeerHandle handle;
  bool was_joined = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    changed_.SignalAll();
  }
  if (thread_.joinable()) thread_.join();
  {
    absl::MutexLock lock(&mu_);
    was_joined = joined_;
    handle = handle_;
    joined_ = false;
  }
  if (was_joined) {
    grpc::ClientContext ctx;
    ctx.set_deadline(DeadlineIn(absl::Seconds(2)));
    v1::LeaveCoordinatorRequest req;
    *req.mutable_handle() = handle;
    v1::LeaveCoordinatorResponse resp;
    grpc::Status s = stub_->LeaveCoordinator(&ctx, req, &resp);
    LOG(INFO) << "node " << options_.node << " left coordinator "
              << options_.coordinator_address
              << (s.ok() ? "" : absl::StrCat(" (", s.error_message(), ")"));
  }
}

v1::PeerHandle MemberLink::handle() const {
  absl::MutexLock lock(&mu_);
  return joined_ ? handle_ : v1::PeerHandle();
}

bool MemberLink::joined() const {
  absl::MutexLock lock(&mu_);
  return joined_;
}

std::string MemberLink::coordinator_node() const {
  absl::MutexLock lock(&mu_);
  return coordinator_node_;
}

void MemberLink::FillHealth(v1::GetHealthResponse* response) const {
  absl::MutexLock lock(&mu_);
  const absl::Duration age = absl::Now() - last_answer_;
  response->set_coordinator_node(coordinator_node_);
  v1::PeerHealth* p = response->add_peers();
  p->set_node(coordinator_node_);
  p->set_peer_address(options_.coordinator_address);
  p->set_reachable(joined_ && age <= lease_);
  p->set_last_heartbeat_age_ms(absl::ToInt64Milliseconds(age));
  if (!joined_) {
    response->add_problems(absl::StrCat(
        "not joined to coordinator ", options_.coordinator_address,
        last_error_.empty() ? "" : absl::StrCat(": ", last_error_)));
  } else if (age > lease_) {
    response->add_problems(absl::StrCat(
        "coordinator ", coordinator_node_, " has not answered heartbeats for ",
        absl::ToInt64Milliseconds(age), " ms"));
  }
}

void MemberLink::Loop() {
  while (true) {
    bool joined;
    v1::PeerHandle handle;
    int64_t epoch;
    absl::Duration lease;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      joined = joined_;
      handle = handle_;
      epoch = epoch_;
      lease = lease_;
    }
    absl::Duration wait = options_.retry_interval;
    if (!joined) {
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineIn(absl::Seconds(2)));
      v1::JoinCoordinatorRequest req;
      req.set_node(options_.node);
      req.set_peer_address(options_.peer_address);
      req.set_daemon_version(kDaemonVersion);
      req.set_replace_existing(true);
      for (const std::string& rail : options_.rails) req.add_rails(rail);
      v1::JoinCoordinatorResponse resp;
      grpc::Status s = stub_->JoinCoordinator(&ctx, req, &resp);
      absl::MutexLock lock(&mu_);
      if (s.ok()) {
        joined_ = true;
        handle_ = resp.handle();
        epoch_ = resp.membership_epoch();
        lease_ = absl::Milliseconds(std::max<int64_t>(resp.lease_duration_ms(), 30));
        last_answer_ = absl::Now();
        last_error_.clear();
        if (resp.members_size() > 0) {
          coordinator_node_ = resp.members(0).node();
        }
        LOG(INFO) << "node " << options_.node << " joined coordinator "
                  << coordinator_node_ << " at "
                  << options_.coordinator_address << " (lease "
                  << resp.lease_duration_ms() << " ms, "
                  << resp.members_size() << " daemons)";
        wait = lease_ / 3;
      } else {
        if (last_error_ != s.error_message()) {
          LOG(WARNING) << "node " << options_.node << ": cannot join "
                       << options_.coordinator_address << ": "
                       << s.error_message();
        }
        last_error_ = s.error_message();
        if (s.error_code() == grpc::StatusCode::FAILED_PRECONDITION ||
            s.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
          wait = absl::Seconds(2);  // misconfiguration: retry slowly
        }
      }
    } else {
      grpc::ClientContext ctx;
      ctx.set_deadline(DeadlineIn(std::max(lease / 3, absl::Milliseconds(100))));
      v1::PeerHeartbeatRequest req;
      *req.mutable_handle() = handle;
      req.set_known_membership_epoch(epoch);
      v1::PeerHeartbeatResponse resp;
      grpc::Status s = stub_->PeerHeartbeat(&ctx, req, &resp);
      absl::MutexLock lock(&mu_);
      if (s.ok()) {
        last_answer_ = absl::Now();
        epoch_ = resp.membership_epoch();
        lease_ = absl::Milliseconds(std::max<int64_t>(resp.lease_duration_ms(), 30));
        wait = lease_ / 3;
      } else if (s.error_code() == grpc::StatusCode::NOT_FOUND ||
                 s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
        LOG(WARNING) << "node " << options_.node << ": coordinator dropped "
                     << "the membership (" << s.error_message()
                     << "); joining again";
        joined_ = false;
        wait = absl::ZeroDuration();
      } else {
        last_error_ = s.error_message();
        wait = options_.retry_interval;  // unreachable: keep trying
      }
    }
    absl::MutexLock lock(&mu_);
    if (!stopping_ && wait > absl::ZeroDuration()) {
      changed_.WaitWithTimeout(&mu_, wait);
    }
  }
}

}  // namespace ferry
