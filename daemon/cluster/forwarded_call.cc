#include "daemon/cluster/forwarded_call.h"

namespace ferry {

void Prepare(const grpc::ServerContextBase* server,
             grpc::ClientContext* client) {
  if (server != nullptr &&
      server->deadline() != std::chrono::system_clock::time_point::max()) {
    client->set_deadline(server->deadline());
  }
}

std::chrono::system_clock::time_point DeadlineOf(
    const grpc::ServerContextBase* server) {
  if (server->deadline() != std::chrono::system_clock::time_point::max()) {
    return server->deadline();
  }
  return std::chrono::system_clock::now() + std::chrono::seconds(30);
}

Forwarded::Forwarded(grpc::CallbackServerContext* server, const Start& start) {
  Prepare(server, &upstream_);
  start(&upstream_, [this](grpc::Status s) {
    Finish(s);
    Unref();
  });
}

}  // namespace ferry
