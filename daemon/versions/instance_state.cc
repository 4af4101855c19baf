// VersionCoordinator, one instance as the rest of the daemon asks about it
// and tells of it (Lifecycle.SwapModel, adapters.h): whether a run keeps it
// busy, whether it is offloaded, that it now follows another registration,
// that it is gone for good.
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/versions/version_coordinator.h"

namespace ferry {

bool VersionCoordinator::IsOffloaded(const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  return offloaded_.count(instance_id) > 0;
}

void VersionCoordinator::ForgetInstance(const std::string& instance_id) {
  absl::MutexLock lock(&mu_);
  records_.erase(instance_id);
  for (auto& [name, st] : streams_) st.bootstrap_tried.erase(instance_id);
  changed_.SignalAll();
}

std::string VersionCoordinator::InstanceBusy(
    const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  if (offloaded_.count(instance_id)) {
    return absl::StrCat("instance ", instance_id,
                        " is offloaded (Lifecycle.Onload it first)");
  }
  for (const auto& [name, st] : streams_) {
    if (st.current != nullptr) {
      for (const InstanceRun& inst : st.current->instances) {
        if (inst.id == instance_id && !inst.settled()) {
          return absl::StrCat("version ", st.current->version,
                              " is in progress on stream ", name);
        }
      }
    }
    if (st.delivery != nullptr &&
        (st.delivery->instances[0].id == instance_id ||
         st.delivery->peer == instance_id)) {
      return absl::StrCat("the ", RunKindName(st.delivery->kind),
                          " of instance ", st.delivery->instances[0].id,
                          " from ", st.delivery->peer,
                          " is in progress on stream ", name);
    }
  }
  return "";
}

void VersionCoordinator::InstanceSwapped(const std::string& instance_id,
                                         const std::string& stream) {
  absl::MutexLock lock(&mu_);
  records_.erase(instance_id);
  for (auto& [name, st] : streams_) st.bootstrap_tried.erase(instance_id);
  bootstrap_wanted_.insert(stream);
  changed_.SignalAll();
}

}  // namespace ferry
