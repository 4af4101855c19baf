// UnixSocketListener: the daemon's unix socket, with a check of who connects.
//
// Role: creates the socket's directory (mode 0700) and the socket (mode
// 0600), accepts connections itself, checks each peer's uid with
// SO_PEERCRED (the daemon's own uid, or root; anyone else is closed and
// logged), and hands accepted connections to the gRPC server with
// grpc::AddInsecureChannelFromFd. gRPC 1.51 exposes no peer credentials of
// a unix connection to handlers (its auth context for a plain unix port is
// empty), so owning the accept is the one way to check them; the
// permissions are a second, independent fence.
//
// Owner: the Server. Threading: one accept thread of its own; Start and
// Stop from the owner's thread. Stop before shutting the gRPC server down.
#ifndef FERRY_DAEMON_SECURITY_UNIX_SOCKET_LISTENER_H_
#define FERRY_DAEMON_SECURITY_UNIX_SOCKET_LISTENER_H_

#include <sys/types.h>

#include <atomic>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "absl/status/statusor.h"
#include "grpcpp/server.h"

namespace ferry {

class CallerIdentity;

// Who besides the daemon's own uid and root may connect.
struct UnixSocketAccess {
  std::set<uid_t> uids;  // these uids too
  bool any_uid = false;  // every uid (the socket is then mode 0666 in a
                         // 0711 directory; each caller's memory is still
                         // mapped only with its own rights)
  bool others() const { return any_uid || !uids.empty(); }

  // From ferryd's --client_uids: "" (none), "all", or "1000,1001";
  // INVALID_ARGUMENT naming the part that is not a uid.
  static absl::StatusOr<UnixSocketAccess> Parse(const std::string& text);
};

class UnixSocketListener {
 public:
  // Creates the directory if needed (0700; an existing one must belong to
  // this user, and is tightened to 0700), removes a stale socket file,
  // binds and listens (0600). FAILED_PRECONDITION when another process
  // still serves the path or the directory belongs to someone else.
  // Each accepted connection's credentials go to `callers` (not owned).
  static absl::StatusOr<std::unique_ptr<UnixSocketListener>> Listen(
      const std::string& path, CallerIdentity* callers,
      UnixSocketAccess access = {});
  ~UnixSocketListener();
  UnixSocketListener(const UnixSocketListener&) = delete;
  UnixSocketListener& operator=(const UnixSocketListener&) = delete;

  // Starts accepting; each accepted, permitted connection joins `server`
  // (not owned; must outlive Stop).
  void Start(grpc::Server* server);
  // Stops accepting, closes and unlinks the socket. Idempotent.
  void Stop();

  const std::string& path() const { return path_; }
  // Connections refused because of their uid (tests).
  int refused() const { return refused_.load(); }

 private:
  UnixSocketListener(std::string path, int fd, CallerIdentity* callers,
                     UnixSocketAccess access);
  bool Admits(uid_t uid) const;
  void AcceptLoop(grpc::Server* server);

  const std::string path_;
  int fd_;
  CallerIdentity* const callers_;
  const UnixSocketAccess access_;
  std::atomic<bool> stopping_{false};
  std::atomic<int> refused_{0};
  std::thread thread_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_SECURITY_UNIX_SOCKET_LISTENER_H_
