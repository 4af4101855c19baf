// The Registry's leases: the reaper thread, which removes participants
// whose lease ran out or whose process exited, and Heartbeat, which renews
// a lease. Part of the Registry class (registry.h: one lock, mu_); the
// reaper calls the listeners with no lock held, as every removal does.
#include "daemon/registry/registry.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

// Only a pid of this node says anything: a forwarded registration keeps 0.
bool ProcessGone(int32_t pid) {
  return pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace

void Registry::StartReaper() {
  reaper_ = std::thread([this] { ReaperLoop(); });
}

void Registry::StopReaper() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (reaper_.joinable()) reaper_.join();
}

void Registry::ReaperLoop() {
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithTimeout(absl::Condition(&stopping_), reaper_interval_);
      if (stopping_) return;
    }
    ReapExpired();
  }
}

void Registry::ReapExpired() {
  std::vector<std::pair<std::shared_ptr<Participant>, std::string>> removed;
  {
    absl::MutexLock lock(&mu_);
    const absl::Time now = clock_->Now();
    std::vector<std::pair<std::string, std::string>> doomed;
    for (const auto& [id, entry] : participants_) {
      if (now > entry.lease_deadline) {
        if (metrics_ != nullptr) {
          metrics_->LeaseExpired(entry.participant->role == Role::kSource
                                     ? "source"
                                     : "destination");
        }
        doomed.emplace_back(id, absl::StrCat("lease expired (no heartbeat for ",
                                             absl::ToInt64Milliseconds(lease_),
                                             " ms)"));
      } else if (ProcessGone(entry.participant->pid)) {
        doomed.emplace_back(
            id, absl::StrCat("process ", entry.participant->pid, " exited"));
      }
    }
    for (auto& [id, why] : doomed) {
      EraseWithAdaptersLocked(id, why, &removed);
    }
  }
  NotifyRemoved(removed);
}

absl::Status Registry::Heartbeat(const v1::ParticipantHandle& handle) {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Entry*> e = FindLocked(handle);
  if (!e.ok()) return e.status();
  (*e)->lease_deadline = clock_->Now() + lease_;
  return absl::OkStatus();
}

absl::Duration Registry::LeaseRemaining(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  auto it = participants_.find(id);
  if (it == participants_.end()) return absl::ZeroDuration();
  return std::max(absl::ZeroDuration(),
                  it->second.lease_deadline - clock_->Now());
}
}  // namespace ferry
