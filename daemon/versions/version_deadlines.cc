// VersionCoordinator, deadlines: the thread that aborts an instance whose
// ack deadline passed, and a run whose version deadline passed.
#include "daemon/versions/version_coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {

void VersionCoordinator::CheckDeadlinesLocked() {
  const absl::Time now = clock_->Now();
  std::vector<std::shared_ptr<VersionRun>> runs;
  for (auto& [name, st] : streams_) {
    if (st.current != nullptr) runs.push_back(st.current);
    if (st.delivery != nullptr) runs.push_back(st.delivery);
  }
  for (const auto& run : runs) {
    bool changed = false;
    for (InstanceRun& inst : run->instances) {
      if (inst.settled() || now <= inst.ack_deadline) continue;
      std::vector<size_t> late;
      for (size_t r = 0; r < inst.waiting_event.size(); ++r) {
        if (inst.waiting_event[r] != 0) late.push_back(r);
      }
      if (late.empty()) continue;
      Abort(
          *run, inst, AbortCause::kAckTimeout,
          absl::StrCat("tp rank", late.size() > 1 ? "s " : " ",
                       absl::StrJoin(late, ", "), " did not ack ",
                       UpdateEventKindName(inst.waiting_kind), " within ",
                       absl::ToInt64Milliseconds(options_.ack_timeout), " ms"));
      changed = true;
    }
    if (now > run->deadline) {
      const std::string limit = absl::StrCat(
          absl::ToInt64Milliseconds(options_.version_timeout),
          run->kind == RunKind::kVersion
              ? " ms of the first CommitVersion"
              : absl::StrCat(" ms of the ", RunKindName(run->kind),
                             "'s start"));
      if (!run->all_committed()) {
        std::vector<int32_t> missing;
        for (int32_t r = 0; r < run->world_size; ++r) {
          if (!run->committed.count(r)) missing.push_back(r);
        }
        AbortRunLocked(*run, AbortCause::kVersionTimeout,
                       absl::StrCat("source ranks [",
                                          absl::StrJoin(missing, ", "),
                                          "] did not commit within ", limit));
      } else {
        for (InstanceRun& inst : run->instances) {
          if (inst.settled()) continue;
          Abort(*run, inst, AbortCause::kVersionTimeout,
                absl::StrCat(
                    "version timeout: not settled within ", limit, " (state ",
                    v1::InstanceState_Name(Status(*run, inst).state()), ")"));
        }
      }
      changed = true;
    }
    if (changed) Advance(run);
  }
}

void VersionCoordinator::DeadlineLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    CheckDeadlinesLocked();
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
  }
}

}  // namespace ferry
