// VersionCoordinator, inspection: stream summaries, an instance's status,
// subscriptions, GetProgress, and what a settled run tells the metrics.
#include "daemon/versions/version_coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {

StreamSummary VersionCoordinator::Summary(
    const std::string& stream) const {
  absl::MutexLock lock(&mu_);
  StreamSummary s;
  auto it = streams_.find(stream);
  if (it == streams_.end()) return s;
  s.latest_committed = it->second.latest_committed;
  s.in_progress =
      it->second.current == nullptr ? 0 : it->second.current->version;
  const std::shared_ptr<VersionRun>& d = it->second.delivery != nullptr
                                             ? it->second.delivery
                                             : it->second.last_delivery;
  deliveries_.AssertHeld();  // mu_ is its lock
  if (d != nullptr) s.delivery = deliveries_.InfoLocked(*d);
  return s;
}

v1::InstanceStatus VersionCoordinator::InstanceStatusOf(
    const std::string& instance_id, int64_t held_version) const {
  absl::MutexLock lock(&mu_);
  auto it = records_.find(instance_id);
  if (it != records_.end()) return it->second;
  v1::InstanceStatus s;
  s.set_instance_id(instance_id);
  s.set_state(v1::INSTANCE_STATE_IDLE);
  s.set_committed_version(held_version);
  return s;
}

bool VersionCoordinator::IsSubscribed(const std::string& participant_id) const {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(participant_id);
  return it != channels_.end() && it->second.subscription != 0;
}

absl::StatusOr<v1::GetProgressResponse> VersionCoordinator::Progress(
    const std::string& stream, int64_t version) const {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    return absl::NotFoundError(
        absl::StrCat("stream ", stream, " has no versions"));
  }
  std::shared_ptr<VersionRun> run;
  if (version == 0) {
    run = it->second.current != nullptr
              ? it->second.current
              : (it->second.history.empty() ? nullptr
                                            : it->second.history.back());
  } else {
    run = FindRunLocked(stream, version);
  }
  if (run == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "stream ", stream, ": no record of version ", version));
  }
  return ProgressLocked(*run);
}

absl::StatusOr<std::vector<v1::GetProgressResponse>> VersionCoordinator::History(
    const std::string& stream) const {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    return absl::NotFoundError(
        absl::StrCat("stream ", stream, " has no versions"));
  }
  std::vector<v1::GetProgressResponse> out;
  if (it->second.current != nullptr) out.push_back(ProgressLocked(*it->second.current));
  for (auto h = it->second.history.rbegin(); h != it->second.history.rend(); ++h) {
    out.push_back(ProgressLocked(**h));
  }
  return out;
}

v1::GetProgressResponse VersionCoordinator::ProgressLocked(
    const VersionRun& run) const {
  v1::GetProgressResponse out;
  out.set_stream(run.stream);
  out.set_version(run.version);
  const absl::Time end = run.settled ? run.settled_at : absl::Now();
  out.set_elapsed_ms(absl::ToInt64Milliseconds(end - run.begun_at));
  int64_t moved = 0, total = 0;
  for (const InstanceRun& inst : run.instances) {
    v1::InstanceProgress* ip = out.add_instances();
    *ip->mutable_status() = Status(run, inst);
    ip->set_bytes_moved(inst.progress->bytes_moved.load());
    ip->set_bytes_total(inst.progress->bytes_total.load());
    ip->set_relayed_from(inst.relayed_from);
    ip->set_given_by(inst.given_by);
    ip->set_patched_bytes(inst.progress->patched_bytes.load());
    ip->set_patch_bytes(inst.progress->patch_bytes.load());
    ip->set_changed_bytes(inst.progress->changed_bytes.load());
    moved += ip->bytes_moved();
    total += ip->bytes_total();
    if (inst.phase == RunPhase::kCommitted) {
      out.set_instances_committed(out.instances_committed() + 1);
    }
    if (inst.phase == RunPhase::kAborted) {
      out.set_instances_aborted(out.instances_aborted() + 1);
    }
  }
  out.set_instances_total(run.instances.size());
  out.set_bytes_moved(moved);
  out.set_bytes_total(total);
  if (moved > 0 && run.first_byte_at != absl::InfiniteFuture()) {
    const double seconds =
        absl::ToDoubleSeconds(end - run.first_byte_at);
    out.set_throughput_bytes_per_second(seconds > 0 ? moved / seconds : 0);
  }
  return out;
}

void VersionCoordinator::ReportSettledLocked(const VersionRun& run) const {
  if (metrics_ == nullptr) return;
  const std::string kind = RunKindName(run.kind);
  metrics_->VersionSettled(run.stream, kind, run.settled_at - run.begun_at);
  auto span = [](absl::Time from, absl::Time to) {
    return from == absl::InfiniteFuture() || to == absl::InfiniteFuture()
               ? absl::InfiniteDuration()
               : to - from;
  };
  for (const InstanceRun& inst : run.instances) {
    // Offloaded: it took no part (an offload's own run is counted).
    if (inst.phase == RunPhase::kOffloaded && run.kind != RunKind::kOffload) {
      continue;
    }
    DaemonMetrics::InstanceOutcome o;
    o.stream = run.stream;
    o.instance = inst.id;
    o.kind = kind;
    o.committed = inst.phase == RunPhase::kCommitted ||
                  inst.phase == RunPhase::kOffloaded;
    o.cause = inst.abort_cause;
    o.version = run.version;
    o.pause = span(inst.pause_sent_at, inst.paused_at);
    o.transfer = span(inst.transfer_started_at, inst.transfer_done_at);
    o.apply = span(inst.transfer_done_at, inst.committed_at);
    o.bytes = inst.progress != nullptr ? inst.progress->bytes_moved.load() : 0;
    o.transport = inst.remote_transfer ? "remote" : "local";
    o.route = run.kind == RunKind::kOffload || run.from_host_copy
                  ? "host_copy"
              : run.kind != RunKind::kVersion ? "peer"
              : inst.relayed_from.empty()     ? "source"
                                              : "relay";
    if (!inst.given_by.empty()) o.given_bytes = o.bytes - inst.first_part_bytes;
    if (inst.progress != nullptr) {
      o.patched_bytes = inst.progress->patched_bytes.load();
      o.patch_bytes = inst.progress->patch_bytes.load();
      o.changed_bytes = inst.progress->changed_bytes.load();
    }
    metrics_->InstanceSettled(o);
  }
}

}  // namespace ferry
