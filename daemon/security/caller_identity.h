// CallerIdentity: who made an RPC, as its transport proves it.
//
// A call arrives over the unix socket or over TCP. Over the unix socket the
// caller is the process at the other end: UnixSocketListener accepts every
// connection itself, reads its SO_PEERCRED (pid, uid, gid) and records it
// here under the connection's fd before handing the fd to gRPC, which names
// such a connection "fd:<n>" (ServerContext::peer()). Over TCP the caller
// is the holder of the client certificate the TLS handshake verified
// (tls_credentials.h); there is no uid.
//
// ferryd maps shared memory a registration names only for a unix caller,
// and only memory that caller could open itself (memory_map.h): a TCP
// caller names memory on no node ferryd can check.
//
// Owner: the Server; the listener writes, the services read.
// Threading: thread-safe.
#ifndef FERRY_DAEMON_SECURITY_CALLER_IDENTITY_H_
#define FERRY_DAEMON_SECURITY_CALLER_IDENTITY_H_

#include <sys/types.h>

#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/memory/memory_map.h"
#include "grpcpp/server_context.h"
#include "transport/device_memory.h"
#include "transport/shared_memory.h"

namespace ferry {

struct Caller {
  enum class Transport { kUnixSocket, kTcp };
  Transport transport = Transport::kTcp;
  // Unix socket: the connecting process's credentials.
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  // TCP: the verified client certificate's CN.
  std::string certificate;

  bool unix_socket() const { return transport == Transport::kUnixSocket; }
};

class CallerIdentity {
 public:
  // The listener, for each accepted connection before gRPC sees it. A fd
  // number is reused only after gRPC closed the connection that had it, so
  // the newest entry for a fd is always that of its live connection.
  void RecordUnixConnection(int fd, pid_t pid, uid_t uid, gid_t gid)
      ABSL_LOCKS_EXCLUDED(mu_);

  // The caller of an RPC in progress. UNAUTHENTICATED for a unix
  // connection this daemon did not accept (cannot happen) or a TCP call
  // without a verified certificate (the TLS processor refuses those first).
  absl::StatusOr<Caller> Of(const grpc::ServerContext& context) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct UnixPeer {
    pid_t pid;
    uid_t uid;
    gid_t gid;
  };
  mutable absl::Mutex mu_;
  std::map<int, UnixPeer> unix_ ABSL_GUARDED_BY(mu_);  // by fd
};

// The rights a registration's shared memory is opened with: the unix
// caller's uid and gid. PERMISSION_DENIED for a TCP caller, which can name
// no memory ferryd could check. `write`: the memory is written (a
// destination's).
absl::StatusOr<RegionAccess> RegistrationAccess(const Caller& caller,
                                                bool write);

// How a registration's memory is mapped for the caller of `context`: with
// its rights (RegistrationAccess), CUDA regions through `devices`.
absl::StatusOr<MapOptions> RegistrationMapping(
    const CallerIdentity& callers, const grpc::ServerContext& context,
    DeviceMemory* devices, bool write);

}  // namespace ferry

#endif  // FERRY_DAEMON_SECURITY_CALLER_IDENTITY_H_
