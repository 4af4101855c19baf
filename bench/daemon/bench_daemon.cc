#include "bench/daemon/bench_daemon.h"

#include <stdlib.h>
#include <unistd.h>

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"

namespace ferry {
namespace bench {

absl::StatusOr<std::unique_ptr<BenchDaemon>> BenchDaemon::Start(
    DaemonOptions options) {
  char dir_template[] = "/tmp/ferry-bench-XXXXXX";
  if (::mkdtemp(dir_template) == nullptr) {
    return absl::InternalError("mkdtemp failed for the bench daemon");
  }
  std::unique_ptr<BenchDaemon> d(new BenchDaemon());
  d->dir_ = dir_template;
  if (options.node.empty()) options.node = "bench";
  options.socket_path = d->dir_ + "/ferryd.sock";
  absl::StatusOr<std::unique_ptr<Server>> server = Server::Start(options);
  if (!server.ok()) return server.status();
  d->server_ = *std::move(server);
  ConnectionOptions copts;
  copts.address = "unix:" + options.socket_path;
  copts.rpc_timeout = absl::Minutes(5);
  absl::StatusOr<Connection> c = Connection::Open(copts);
  if (!c.ok()) return c.status();
  if (absl::Status s = c->WaitForReady(absl::Seconds(10)); !s.ok()) return s;
  d->connection_ = std::make_unique<Connection>(*std::move(c));
  return d;
}

BenchDaemon::~BenchDaemon() {
  connection_.reset();
  if (server_ != nullptr) server_->Shutdown();
  server_.reset();
  ::unlink((dir_ + "/ferryd.sock").c_str());
  ::rmdir(dir_.c_str());
}

}  // namespace bench
}  // namespace ferry
