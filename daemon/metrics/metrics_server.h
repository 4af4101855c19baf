// MetricsServer: serves GET /metrics (Prometheus text exposition) over
// plain HTTP on --metrics_address, through civetweb (Debian's
// libcivetweb-dev): a well-kept HTTP server, not a parser of our own.
// Read-only and unauthenticated, as Prometheus endpoints are: bind it to
// an address only the scraper reaches (docs/operations.md, "Metrics").
#ifndef FERRY_DAEMON_METRICS_METRICS_SERVER_H_
#define FERRY_DAEMON_METRICS_METRICS_SERVER_H_

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"

struct mg_context;
struct mg_connection;

namespace ferry {

class MetricsServer {
 public:
  // Listens on `address` ("HOST:PORT", "[V6]:PORT" or ":PORT" for every
  // interface; port 0 picks a free one) and answers /metrics with
  // `render()`, which must be thread-safe. INVALID_ARGUMENT for a
  // malformed address, UNAVAILABLE when it cannot listen.
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(
      const std::string& address, std::function<std::string()> render);
  ~MetricsServer();  // stops serving; waits for requests in flight
  MetricsServer(const MetricsServer&) = delete;
  MetricsServer& operator=(const MetricsServer&) = delete;

  int port() const { return port_; }  // the port it listens on

 private:
  MetricsServer(std::function<std::string()> render)
      : render_(std::move(render)) {}
  static int HandleMetrics(mg_connection* conn, void* self);

  std::function<std::string()> render_;
  mg_context* context_ = nullptr;
  int port_ = 0;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_METRICS_METRICS_SERVER_H_
