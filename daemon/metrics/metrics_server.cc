#include "daemon/metrics/metrics_server.h"

#include <civetweb.h>

#include <cstring>
#include <mutex>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

// civetweb's listening_ports syntax: "127.0.0.1:9400", "[::1]:9400", or a
// bare port for every interface.
absl::StatusOr<std::string> ListeningPorts(const std::string& address) {
  const size_t colon = address.rfind(':');
  int port = -1;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--metrics_address '", address,
        "' must be HOST:PORT, [IPV6]:PORT or :PORT (port 0 to 65535)"));
  }
  const std::string host = address.substr(0, colon);
  if (host.empty()) return std::to_string(port);
  return absl::StrCat(host, ":", port);
}

}  // namespace

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(
    const std::string& address, std::function<std::string()> render) {
  absl::StatusOr<std::string> ports = ListeningPorts(address);
  if (!ports.ok()) return ports.status();
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  std::unique_ptr<MetricsServer> server(new MetricsServer(std::move(render)));
  // Two threads: a scrape renders in microseconds; nobody else calls.
  const char* options[] = {"listening_ports", ports->c_str(),
                           "num_threads",     "2",
                           "request_timeout_ms", "10000",
                           nullptr};
  mg_callbacks callbacks;
  std::memset(&callbacks, 0, sizeof callbacks);
  server->context_ = mg_start(&callbacks, nullptr, options);
  if (server->context_ == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve metrics on ", address,
        " (in use, or not an address of this host?)"));
  }
  mg_set_request_handler(server->context_, "/metrics", &HandleMetrics,
                         server.get());
  mg_server_port bound[4];
  std::memset(bound, 0, sizeof bound);
  const int n = mg_get_server_ports(server->context_, 4, bound);
  if (n > 0) server->port_ = bound[0].port;
  return server;
}

MetricsServer::~MetricsServer() {
  if (context_ != nullptr) mg_stop(context_);
}

int MetricsServer::HandleMetrics(mg_connection* conn, void* self) {
  const mg_request_info* request = mg_get_request_info(conn);
  if (request == nullptr || std::strcmp(request->request_method, "GET") != 0) {
    mg_printf(conn,
              "HTTP/1.1 405 Method Not Allowed\r\nAllow: GET\r\n"
              "Content-Length: 0\r\nConnection: close\r\n\r\n");
    return 405;
  }
  const std::string body = static_cast<MetricsServer*>(self)->render_();
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\n"
            "Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            body.size());
  mg_write(conn, body.data(), body.size());
  return 200;
}

}  // namespace ferry
