// VersionCoordinator, whether a stream or an instance is busy (the one
// rule every run kind asks before it starts, and Lifecycle.SwapModel), the
// records of streams and instances as the collaborators find them
// (RunDriver, run_driver.h), and one instance as the rest of the daemon
// asks about it and tells of it (adapters.h, model_swaps.cc): offloaded
// (OffloadRuns, offload_runs.h, answers), following another registration,
// gone for good.
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/versions/version_coordinator.h"

namespace ferry {

void VersionCoordinator::ForgetInstance(const std::string& instance_id) {
  absl::MutexLock lock(&mu_);
  records_.erase(instance_id);
  for (auto& [name, st] : streams_) st.bootstrap_tried.erase(instance_id);
  changed_.SignalAll();
}

std::string VersionCoordinator::Busy(const std::string& stream,
                                     const std::string& instance_id) const {
  if (instance_id.empty() && shutting_down_) return "ferryd is shutting down";
  offloads_.AssertHeld();  // mu_ is its lock
  if (!instance_id.empty() && offloads_.IsOffloadedLocked(instance_id)) {
    return absl::StrCat("instance ", instance_id,
                        " is offloaded (Lifecycle.Onload it first)");
  }
  // A version counts for an instance while it takes part and has not
  // settled; a delivery (or offload, onload, unload) while it writes or
  // reads the instance.
  auto in_version = [&](const VersionRun& run) {
    if (instance_id.empty()) return true;
    for (const InstanceRun& inst : run.instances) {
      if (inst.id == instance_id && !inst.settled()) return true;
    }
    return false;
  };
  auto in_delivery = [&](const VersionRun& run) {
    return instance_id.empty() || run.instances[0].id == instance_id ||
           run.donor == instance_id;
  };
  for (const auto& [name, st] : streams_) {
    if (!stream.empty() && name != stream) continue;
    if (st.current != nullptr && in_version(*st.current)) {
      return absl::StrCat("version ", st.current->version,
                          " is in progress on stream ", name);
    }
    if (st.delivery != nullptr && in_delivery(*st.delivery)) {
      const VersionRun& d = *st.delivery;
      return absl::StrCat(
          "the ", RunKindName(d.kind), " of instance ", d.instances[0].id,
          d.donor.empty() ? std::string() : absl::StrCat(" from ", d.donor),
          " is in progress on stream ", name);
    }
  }
  return "";
}

bool VersionCoordinator::ShuttingDown() const {
  mu_.AssertHeld();
  return shutting_down_;
}

bool VersionCoordinator::Offloaded(const std::string& instance_id) const {
  offloads_.AssertHeld();  // a collaborator calls with mu_, its lock, held
  return offloads_.IsOffloadedLocked(instance_id);
}

bool VersionCoordinator::BootstrapPending(const std::string& stream) const {
  deliveries_.AssertHeld();  // a collaborator calls with mu_, its lock, held
  return deliveries_.PendingLocked(stream);
}

int32_t VersionCoordinator::ChooseDonor(const StreamPlan& sp, int32_t target,
                                        int64_t version,
                                        std::string* why) const {
  deliveries_.AssertHeld();  // OffloadRuns calls with mu_, its lock, held
  return deliveries_.ChooseDonorLocked(sp, target, version, why);
}

const v1::InstanceStatus* VersionCoordinator::FindRecord(
    const std::string& id) const {
  mu_.AssertHeld();
  auto it = records_.find(id);
  return it == records_.end() ? nullptr : &it->second;
}

v1::InstanceStatus& VersionCoordinator::RecordOf(const std::string& id) {
  mu_.AssertHeld();
  return records_[id];
}

const StreamState* VersionCoordinator::FindStream(
    const std::string& stream) const {
  mu_.AssertHeld();
  auto it = streams_.find(stream);
  return it == streams_.end() ? nullptr : &it->second;
}

StreamState& VersionCoordinator::StreamOf(const std::string& stream) {
  mu_.AssertHeld();
  return streams_[stream];
}

std::string VersionCoordinator::InstanceBusy(
    const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  return Busy(/*stream=*/"", instance_id);
}

void VersionCoordinator::InstanceSwapped(const std::string& instance_id,
                                         const std::string& stream) {
  absl::MutexLock lock(&mu_);
  records_.erase(instance_id);
  for (auto& [name, st] : streams_) st.bootstrap_tried.erase(instance_id);
  deliveries_.AssertHeld();  // mu_ is its lock
  deliveries_.WantLocked(stream);
  changed_.SignalAll();
}

}  // namespace ferry
