// DaemonMetrics: what ferryd counts for Prometheus (docs/operations.md,
// "Metrics"), served on --metrics_address by the MetricsServer. The owners
// of the events call the methods below; gauges that are a state, not an
// event (participants, staging in use), are read at scrape time through
// the collector the Server installs.
//
// Label values are bounded: streams, instances and roles registered with
// this daemon, and fixed words (kind, outcome, cause, phase, transport,
// route). Never a version number: the last committed version is a gauge's
// value.
#ifndef FERRY_DAEMON_METRICS_DAEMON_METRICS_H_
#define FERRY_DAEMON_METRICS_DAEMON_METRICS_H_

#include <functional>
#include <string>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/metrics/metrics.h"

namespace ferry {

// Why an instance's version aborted, as a bounded class (the reason text
// itself goes to the instance's status and the log).
enum class AbortCause {
  kRankFailed,      // a rank acked an event FAILED (its callback's error)
  kAckTimeout,      // a rank did not ack within --ack_timeout_ms
  kVersionTimeout,  // not settled within --version_timeout_ms
  kRankLost,        // a destination rank left or died
  kSourceLost,      // a source rank (trainer, or a delivery's peer) left
  kSourceAbort,     // a source called AbortVersion
  kPlan,            // the instance's layout did not plan
  kStaging,         // no room for its fallback staging
  kTransfer,        // the copy failed
  kShutdown,        // ferryd is shutting down
  kNoCopy,          // onloaded with no copy of the latest version anywhere
};
const char* AbortCauseName(AbortCause cause);  // "ack_timeout", ...

class DaemonMetrics {
 public:
  DaemonMetrics();
  DaemonMetrics(const DaemonMetrics&) = delete;
  DaemonMetrics& operator=(const DaemonMetrics&) = delete;

  // kind: "version", "bootstrap" or "reload".
  void VersionBegun(const std::string& stream, const std::string& kind);
  void VersionSettled(const std::string& stream, const std::string& kind,
                      absl::Duration took);
  // One instance's outcome of a run. Phases not reached are
  // absl::InfiniteDuration() and not observed.
  struct InstanceOutcome {
    std::string stream, instance, kind;
    bool committed = false;
    AbortCause cause = AbortCause::kRankFailed;  // when !committed
    int64_t version = 0;                         // when committed
    absl::Duration pause = absl::InfiniteDuration();
    absl::Duration transfer = absl::InfiniteDuration();
    absl::Duration apply = absl::InfiniteDuration();
    int64_t bytes = 0;        // landed in its buffers and staging
    std::string transport;    // "local" (this node) or "remote"
    std::string route;        // "source", "relay" or "peer"
    // Of `bytes`, those its exchange partner gave it (route "exchange").
    int64_t given_bytes = 0;
    // Delta versions: of `bytes`, those that came as patches, the
    // patches' bytes on the wire, and the bytes that changed.
    int64_t patched_bytes = 0, patch_bytes = 0, changed_bytes = 0;
  };
  void InstanceSettled(const InstanceOutcome& o);
  void LeaseExpired(const std::string& role);
  // A channel to another node opened: the first to it, or a reconnect
  // (the kept one broke: its daemon restarted, the network cut it).
  void ChannelOpened(const std::string& transport, bool first);
  void PlanLookup(bool hit);

  // Scrape-time gauges: `collect` fills `participants` and
  // `staging_bytes` (after they are cleared) before each render.
  void set_collector(std::function<void(DaemonMetrics&)> collect)
      ABSL_LOCKS_EXCLUDED(mu_);
  std::string Render() ABSL_LOCKS_EXCLUDED(mu_);

  MetricRegistry registry;
  MetricFamily* const versions_begun;
  MetricFamily* const version_seconds;
  MetricFamily* const instance_versions;
  MetricFamily* const phase_seconds;
  MetricFamily* const bytes_moved;
  MetricFamily* const patch_bytes;
  MetricFamily* const committed_version;
  MetricFamily* const lease_expiries;
  MetricFamily* const channel_opens;
  MetricFamily* const plan_lookups;
  MetricFamily* const participants;
  MetricFamily* const staging_bytes;

 private:
  absl::Mutex mu_;  // one render at a time; guards collect_
  std::function<void(DaemonMetrics&)> collect_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_METRICS_DAEMON_METRICS_H_
