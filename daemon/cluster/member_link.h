// MemberLink: a member daemon's side of membership (--coordinator).
//
// Joins the coordinator (Peer.JoinCoordinator with replace_existing, so a
// restarted daemon takes its node back at once instead of waiting for its
// old lease), then renews the lease with PeerHeartbeat every third of it.
// A heartbeat answered NOT_FOUND (the lease ran out meanwhile) joins again;
// an unreachable coordinator is retried every few hundred ms, and the link
// reports it unreachable once a lease has passed without an answer. Stop
// leaves the coordinator (LeaveCoordinator).
//
// Owner: the Server. Threading: thread-safe; one thread of its own.
#ifndef FERRY_DAEMON_CLUSTER_MEMBER_LINK_H_
#define FERRY_DAEMON_CLUSTER_MEMBER_LINK_H_

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/security/credentials.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/peer.grpc.pb.h"

namespace ferry {

class MemberLink {
 public:
  struct Options {
    std::string node;                 // this daemon's node name
    std::string peer_address;         // where this daemon serves Peer
    std::string coordinator_address;  // "host:port" of the coordinator
    // How this daemon proves itself to the coordinator (mutual TLS).
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    absl::Duration retry_interval = absl::Milliseconds(250);
    // Its rails (DaemonOptions::rails), told the coordinator at join.
    std::vector<std::string> rails;
  };

  explicit MemberLink(const Options& options);
  ~MemberLink();  // Stop()
  MemberLink(const MemberLink&) = delete;
  MemberLink& operator=(const MemberLink&) = delete;

  // Before Start (the address is known once bound).
  void set_peer_address(const std::string& address) {
    options_.peer_address = address;
  }

  void Start();
  // Leaves the coordinator (best effort, 2 s) and joins the thread.
  // Idempotent.
  void Stop() ABSL_LOCKS_EXCLUDED(mu_);

  bool joined() const ABSL_LOCKS_EXCLUDED(mu_);
  // The membership handle (ForwardRegistration); empty node until joined.
  v1::PeerHandle handle() const ABSL_LOCKS_EXCLUDED(mu_);
  // The coordinator's node name once joined (else empty).
  std::string coordinator_node() const ABSL_LOCKS_EXCLUDED(mu_);
  // For GetHealth: the coordinator as the one peer, and a problem line when
  // it has not answered within a lease.
  void FillHealth(v1::GetHealthResponse* response) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  Options options_;  // peer_address set before Start; then read-only
  std::unique_ptr<v1::Peer::Stub> stub_;

  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool joined_ ABSL_GUARDED_BY(mu_) = false;
  v1::PeerHandle handle_ ABSL_GUARDED_BY(mu_);
  std::string coordinator_node_ ABSL_GUARDED_BY(mu_);
  int64_t epoch_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Duration lease_ ABSL_GUARDED_BY(mu_) = absl::Seconds(10);
  absl::Time last_answer_ ABSL_GUARDED_BY(mu_);
  std::string last_error_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_MEMBER_LINK_H_
