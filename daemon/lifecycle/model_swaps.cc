#include "daemon/lifecycle/model_swaps.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "glog/logging.h"

namespace ferry {

void ModelSwaps::FinishLocked(Pending& p, absl::Status status) {
  p.done = true;
  p.status = std::move(status);
  p.ranks.clear();  // unmaps the new registrations of a failed swap
  changed_.SignalAll();
}

void ModelSwaps::Fail(const std::string& instance_id, int32_t tp_rank,
                      const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  auto it = pending_.find(instance_id);
  if (it == pending_.end()) return;
  std::shared_ptr<Pending> p = it->second;
  pending_.erase(it);
  FinishLocked(*p, absl::AbortedError(absl::StrCat(
                       "SwapModel of instance ", instance_id, ": tp rank ",
                       tp_rank, "'s new registration is invalid (",
                       why.message(), "); every rank stays on the old "
                       "registration")));
}

absl::StatusOr<std::shared_ptr<const Participant>> ModelSwaps::Swap(
    const std::shared_ptr<const Participant>& old,
    std::unique_ptr<Participant> fresh, const std::function<bool()>& expired) {
  const std::string instance = old->instance_id;
  const int32_t tp_rank = old->tp_rank;
  // A version or delivery on the instance now: refuse before waiting.
  const std::string busy = coordinator_->InstanceBusy(instance);
  if (!busy.empty()) {
    Fail(instance, tp_rank, absl::FailedPreconditionError(busy));
    return absl::FailedPreconditionError(
        absl::StrCat("SwapModel of instance ", instance, ": ", busy));
  }
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Pending>& slot = pending_[instance];
  if (slot == nullptr) {
    slot = std::make_shared<Pending>();
    slot->tp_size = old->tp_size;
  }
  std::shared_ptr<Pending> p = slot;
  if (p->ranks.count(tp_rank)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "SwapModel of instance ", instance, ": tp rank ", tp_rank,
        " already called for this swap"));
  }
  p->ranks[tp_rank] = std::move(fresh);
  if (static_cast<int32_t>(p->ranks.size()) == p->tp_size) {
    // The last rank switches the instance, outside the lock: the Registry
    // tells its listeners, which may take a while.
    pending_.erase(instance);
    std::vector<std::unique_ptr<Participant>> ranks;
    for (auto& [tp, r] : p->ranks) ranks.push_back(std::move(r));
    p->ranks.clear();
    mu_.Unlock();
    absl::Status status;
    std::vector<std::shared_ptr<const Participant>> added;
    const std::string now_busy = coordinator_->InstanceBusy(instance);
    if (!now_busy.empty()) {
      status = absl::FailedPreconditionError(
          absl::StrCat("SwapModel of instance ", instance, ": ", now_busy));
    } else {
      const std::string stream = ranks[0]->stream;
      absl::StatusOr<std::vector<std::shared_ptr<const Participant>>> r =
          registry_->ReplaceInstance(instance, std::move(ranks));
      if (r.ok()) {
        added = *std::move(r);
        coordinator_->InstanceSwapped(instance, stream);
        LOG(INFO) << "instance " << instance << " swapped to stream " << stream;
      } else {
        status = r.status();
      }
    }
    mu_.Lock();
    for (const auto& a : added) p->result[a->tp_rank] = a;
    FinishLocked(*p, status);
  } else {
    const absl::Time deadline = absl::Now() + wait_;
    while (!p->done) {
      if ((expired && expired()) || absl::Now() >= deadline) {
        std::vector<int32_t> missing;
        for (int32_t r = 0; r < p->tp_size; ++r) {
          if (!p->ranks.count(r)) missing.push_back(r);
        }
        auto it = pending_.find(instance);
        if (it != pending_.end() && it->second == p) pending_.erase(it);
        FinishLocked(
            *p, absl::AbortedError(absl::StrCat(
                    "SwapModel of instance ", instance,
                    (expired && expired())
                        ? absl::StrCat(": tp rank ", tp_rank,
                                       "'s call ended before tp ranks [")
                        : std::string(": tp ranks ["),
                    absl::StrJoin(missing, ", "), "] called",
                    (expired && expired())
                        ? ""
                        : absl::StrCat(" within ",
                                       absl::ToInt64Milliseconds(wait_),
                                       " ms"),
                    "; every rank stays on the old registration")));
        break;
      }
      changed_.WaitWithDeadline(&mu_, std::min(deadline,
                                               absl::Now() + absl::Milliseconds(100)));
    }
  }
  if (!p->status.ok()) {
    if (absl::IsAborted(p->status) || absl::IsFailedPrecondition(p->status)) {
      return p->status;
    }
    // A rank the Registry refused: everyone stays; the message names it.
    return absl::Status(p->status.code(),
                        absl::StrCat("SwapModel of instance ", instance, ": ",
                                     p->status.message(),
                                     "; every rank stays on the old "
                                     "registration"));
  }
  auto it = p->result.find(tp_rank);
  if (it == p->result.end()) {
    return absl::InternalError(absl::StrCat("SwapModel of instance ", instance,
                                            ": tp rank ", tp_rank,
                                            " has no new registration"));
  }
  return it->second;
}

}  // namespace ferry
