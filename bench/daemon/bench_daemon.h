// BenchDaemon: the in-process ferryd a same-node benchmark runs against, on
// a unix socket in a fresh /tmp directory, and a Connection to it (calls
// may take minutes: a whole model moves). Shut down and the directory
// removed when destroyed, so destroy the benchmark's clients first.
#ifndef FERRY_BENCH_DAEMON_BENCH_DAEMON_H_
#define FERRY_BENCH_DAEMON_BENCH_DAEMON_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "client/connection.h"
#include "daemon/daemon_options.h"
#include "daemon/server.h"

namespace ferry {
namespace bench {

class BenchDaemon {
 public:
  // `options`' node defaults to "bench"; its socket_path is set here.
  static absl::StatusOr<std::unique_ptr<BenchDaemon>> Start(
      DaemonOptions options = DaemonOptions());
  ~BenchDaemon();
  BenchDaemon(const BenchDaemon&) = delete;
  BenchDaemon& operator=(const BenchDaemon&) = delete;

  const Connection& connection() const { return *connection_; }

 private:
  BenchDaemon() = default;
  std::string dir_;
  std::unique_ptr<Server> server_;
  std::unique_ptr<Connection> connection_;
};

}  // namespace bench
}  // namespace ferry

#endif  // FERRY_BENCH_DAEMON_BENCH_DAEMON_H_
