#include "daemon/metrics/daemon_metrics.h"

#include <algorithm>
#include <utility>

namespace ferry {
namespace {

// Seconds: a version on one node takes milliseconds to seconds; across a
// cluster, up to minutes.
std::vector<double> DurationBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,   1,      2.5,   5,    10,    30,   60,  120};
}

}  // namespace

const char* AbortCauseName(AbortCause cause) {
  switch (cause) {
    case AbortCause::kRankFailed:
      return "rank_failed";
    case AbortCause::kAckTimeout:
      return "ack_timeout";
    case AbortCause::kVersionTimeout:
      return "version_timeout";
    case AbortCause::kRankLost:
      return "rank_lost";
    case AbortCause::kSourceLost:
      return "source_lost";
    case AbortCause::kSourceAbort:
      return "source_abort";
    case AbortCause::kPlan:
      return "plan";
    case AbortCause::kStaging:
      return "staging";
    case AbortCause::kTransfer:
      return "transfer";
    case AbortCause::kShutdown:
      return "shutdown";
    case AbortCause::kNoCopy:
      return "no_copy";
  }
  return "unknown";
}

DaemonMetrics::DaemonMetrics()
    : versions_begun(registry.Counter(
          "ferry_versions_begun_total",
          "Runs of the version protocol begun, by stream and kind (version: "
          "from the sources; bootstrap, reload: from a peer instance).",
          {"stream", "kind"})),
      version_seconds(registry.Histogram(
          "ferry_version_duration_seconds",
          "Runs from begin to settled (every instance committed or aborted).",
          {"stream", "kind"}, DurationBuckets())),
      instance_versions(registry.Counter(
          "ferry_instance_versions_total",
          "Instance outcomes of runs: committed, or aborted with the cause "
          "class (cause is \"none\" when committed).",
          {"stream", "instance", "outcome", "cause"})),
      phase_seconds(registry.Histogram(
          "ferry_version_phase_seconds",
          "Per instance and run: pause (PAUSE sent to every rank paused), "
          "transfer (the copy), apply (transfer done to every rank acked "
          "APPLY).",
          {"stream", "phase"}, DurationBuckets())),
      bytes_moved(registry.Counter(
          "ferry_transferred_bytes_total",
          "Bytes landed in instances' buffers and staging, by transport "
          "(local: copied on this node; remote: through a member daemon) "
          "and route (source, relay from a replica, exchange from a partner "
          "replica, peer delivery), and form (dense: the bytes themselves; "
          "patch: sent as a patch against the version the instance held, "
          "delta versions).",
          {"stream", "transport", "route", "form"})),
      patch_bytes(registry.Counter(
          "ferry_patch_bytes_total",
          "Delta versions: what the bytes of form=\"patch\" cost: wire "
          "(the patches' bytes on the network) and changed (the bytes of the "
          "2-byte chunks that differed from the version the instance held).",
          {"stream", "what"})),
      committed_version(registry.Gauge(
          "ferry_instance_committed_version",
          "The last version each instance committed.",
          {"stream", "instance"})),
      lease_expiries(registry.Counter(
          "ferry_lease_expiries_total",
          "Participants removed because their lease ran out (no heartbeat).",
          {"role"})),
      channel_opens(registry.Counter(
          "ferry_channel_opens_total",
          "Data channels to other nodes opened, by transport (tcp, nccl) "
          "and kind (first; reconnect: the kept channel had broken).",
          {"transport", "kind"})),
      plan_lookups(registry.Counter(
          "ferry_plan_cache_lookups_total",
          "Plan lookups: hit (membership unchanged) or miss (planned anew).",
          {"result"})),
      participants(registry.Gauge(
          "ferry_participants", "Registered participants, by role.",
          {"role"})),
      staging_bytes(registry.Gauge(
          "ferry_staging_bytes",
          "Staging reserved for fallback tensors, and ferryd's limit.",
          {"state"})) {}

void DaemonMetrics::VersionBegun(const std::string& stream,
                                 const std::string& kind) {
  versions_begun->Add({stream, kind}, 1);
}

void DaemonMetrics::VersionSettled(const std::string& stream,
                                   const std::string& kind,
                                   absl::Duration took) {
  version_seconds->Observe({stream, kind}, absl::ToDoubleSeconds(took));
}

void DaemonMetrics::InstanceSettled(const InstanceOutcome& o) {
  instance_versions->Add(
      {o.stream, o.instance, o.committed ? "committed" : "aborted",
       o.committed ? "none" : AbortCauseName(o.cause)},
      1);
  if (o.committed) committed_version->Set({o.stream, o.instance}, o.version);
  const std::pair<const char*, absl::Duration> phases[] = {
      {"pause", o.pause}, {"transfer", o.transfer}, {"apply", o.apply}};
  for (const auto& [phase, d] : phases) {
    if (d != absl::InfiniteDuration() && d >= absl::ZeroDuration()) {
      phase_seconds->Observe({o.stream, phase}, absl::ToDoubleSeconds(d));
    }
  }
  // Patches count on the instance's own route (an exchange's given part
  // goes dense or patched alike; counted with the route's).
  const int64_t own = o.bytes - o.given_bytes;
  const int64_t patched = std::min(o.patched_bytes, std::max<int64_t>(own, 0));
  if (own - patched > 0) {
    bytes_moved->Add({o.stream, o.transport, o.route, "dense"}, own - patched);
  }
  if (patched > 0) {
    bytes_moved->Add({o.stream, o.transport, o.route, "patch"}, patched);
  }
  if (o.given_bytes > 0) {
    bytes_moved->Add({o.stream, o.transport, "exchange", "dense"},
                     o.given_bytes);
  }
  if (o.patch_bytes > 0) patch_bytes->Add({o.stream, "wire"}, o.patch_bytes);
  if (o.changed_bytes > 0) {
    patch_bytes->Add({o.stream, "changed"}, o.changed_bytes);
  }
}

void DaemonMetrics::LeaseExpired(const std::string& role) {
  lease_expiries->Add({role}, 1);
}

void DaemonMetrics::ChannelOpened(const std::string& transport, bool first) {
  channel_opens->Add({transport, first ? "first" : "reconnect"}, 1);
}

void DaemonMetrics::PlanLookup(bool hit) {
  plan_lookups->Add({hit ? "hit" : "miss"}, 1);
}

void DaemonMetrics::set_collector(std::function<void(DaemonMetrics&)> collect) {
  absl::MutexLock lock(&mu_);
  collect_ = std::move(collect);
}

std::string DaemonMetrics::Render() {
  absl::MutexLock lock(&mu_);
  participants->Clear();
  staging_bytes->Clear();
  if (collect_) collect_(*this);
  return registry.Render();
}

}  // namespace ferry
