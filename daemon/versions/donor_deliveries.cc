// DonorDeliveries (donor_deliveries.h): an instance filled with the
// stream's latest committed version from a donor instance that holds it (a
// bootstrap of a late instance, ReloadInPlace); the donor's choice; the
// delivery thread.
#include "daemon/versions/donor_deliveries.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/plans/donor_plan.h"
#include "glog/logging.h"

namespace ferry {

DonorDeliveries::DonorDeliveries(absl::Mutex& mu, absl::CondVar& changed,
                                 RunDriver* driver, PlanCache* plans)
    : mu_(mu), changed_(changed), driver_(driver), plans_(plans) {}

DonorDeliveries::~DonorDeliveries() { Join(); }

void DonorDeliveries::Start() {
  thread_ = std::thread([this] { DeliveryLoop(); });
}

void DonorDeliveries::StopLocked() { stopping_ = true; }

void DonorDeliveries::Join() {
  if (thread_.joinable()) thread_.join();
}

void DonorDeliveries::WantLocked(const std::string& stream) {
  bootstrap_wanted_.insert(stream);
}

void DonorDeliveries::RunSettledLocked(const std::string& stream) {
  // Only then: planning the stream after every version would cost a
  // registry snapshot per version for nothing.
  if (bootstrap_deferred_.erase(stream) > 0) bootstrap_wanted_.insert(stream);
}

bool DonorDeliveries::PendingLocked(const std::string& stream) const {
  return bootstrap_wanted_.count(stream) > 0 ||
         bootstrap_checking_.count(stream) > 0;
}

std::string DonorDeliveries::DeliveryBlockedLocked(
    const std::string& stream) const {
  const StreamState* st = driver_->FindStream(stream);
  if (!driver_->ShuttingDown() &&
      (st == nullptr || st->latest_committed == 0)) {
    return absl::StrCat("stream ", stream, " has no committed version yet");
  }
  return driver_->Busy(stream, /*instance_id=*/"");
}

int32_t DonorDeliveries::ChooseDonorLocked(const StreamPlan& sp,
                                           int32_t target, int64_t version,
                                           std::string* why) const {
  const PlannedInstance& t = sp.instances[target];
  int32_t best = -1;
  std::vector<std::string> reasons;
  for (size_t i = 0; i < sp.instances.size(); ++i) {
    if (static_cast<int32_t>(i) == target) continue;
    const PlannedInstance& c = sp.instances[i];
    const v1::InstanceStatus* rec = driver_->FindRecord(c.id);
    if (rec == nullptr || rec->state() != v1::INSTANCE_STATE_COMMITTED ||
        rec->committed_version() != version) {
      reasons.push_back(absl::StrCat(
          c.id, " does not hold version ", version, " (",
          rec == nullptr ? std::string("it never took part in a version")
                         : absl::StrCat(v1::InstanceState_Name(rec->state()),
                                        " at version ",
                                        rec->committed_version()),
          ")"));
      continue;
    }
    std::string unfit = DonorUnfitReason(sp, static_cast<int32_t>(i));
    if (unfit.empty() && !c.options.serve_as_peer) {
      unfit = absl::StrCat(c.id, " has serve_as_peer false");
    }
    if (!unfit.empty()) {
      reasons.push_back(unfit);
      continue;
    }
    // Rank to rank when the TP sizes match; any other fit is resharded.
    if (best < 0 || (c.ranks.size() == t.ranks.size() &&
                     sp.instances[best].ranks.size() != t.ranks.size())) {
      best = static_cast<int32_t>(i);
    }
  }
  if (best < 0) {
    *why = absl::StrCat(
        "no instance holds version ", version, " and can serve as a peer",
        reasons.empty() ? std::string(" (no other instance is registered)")
                        : absl::StrCat(": ", absl::StrJoin(reasons, "; ")));
  }
  return best;
}

std::shared_ptr<VersionRun> DonorDeliveries::StartDeliveryLocked(
    std::shared_ptr<const StreamPlan> plan, RunKind kind,
    const std::string& donor, int64_t version) {
  // No source commits to wait for: the donor holds the version.
  std::shared_ptr<VersionRun> run = driver_->StartSlotRun(
      std::move(plan), /*target=*/0, kind, version, donor);
  InstanceRun& inst = run->instances[0];
  LOG(INFO) << "stream " << run->stream << ": " << RunKindName(kind)
            << " of instance " << inst.id << " at version " << version
            << " from peer instance " << donor << " ("
            << inst.progress->bytes_total.load() << " bytes)";
  driver_->StartInstance(*run, inst);
  driver_->Advance(run);
  return run;
}

void DonorDeliveries::BootstrapStream(const std::string& stream) {
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return;
  const StreamPlan& sp = **plan;
  int32_t target = -1, donor = -1;
  int64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    // A version or delivery in progress (or none committed yet): the
    // stream is looked at again when a run settles (RunSettledLocked).
    if (!DeliveryBlockedLocked(stream).empty()) {
      bootstrap_deferred_.insert(stream);
      return;
    }
    StreamState& st = driver_->StreamOf(stream);
    version = st.latest_committed;
    for (size_t i = 0; i < sp.instances.size() && target < 0; ++i) {
      const PlannedInstance& pi = sp.instances[i];
      if (!pi.error.empty() || RetiringAdapter(pi)) continue;
      // Late instances only: never part of a version here, or IDLE after
      // a rank restarted with older weights. An instance that aborted
      // (dirty) waits for the next version or a ReloadInPlace.
      int64_t held = pi.ranks[0]->held_version;
      for (const auto& r : pi.ranks) held = std::min(held, r->held_version);
      const v1::InstanceStatus* rec = driver_->FindRecord(pi.id);
      if (rec != nullptr) {
        if (rec->state() != v1::INSTANCE_STATE_IDLE) continue;
        held = rec->committed_version();
      }
      if (held >= version) continue;
      const std::pair<int64_t, uint64_t> attempt{version, sp.epoch};
      auto tried = st.bootstrap_tried.find(pi.id);
      if (tried != st.bootstrap_tried.end() && tried->second == attempt) {
        continue;
      }
      std::string why;
      const int32_t p =
          ChooseDonorLocked(sp, static_cast<int32_t>(i), version, &why);
      if (p < 0) {
        v1::InstanceStatus& s = driver_->RecordOf(pi.id);
        if (rec == nullptr) {
          s.set_instance_id(pi.id);
          s.set_state(v1::INSTANCE_STATE_IDLE);
          s.set_committed_version(held);
        }
        s.set_waiting_reason(absl::StrCat(
            "behind the stream's latest committed version ", version, "; ",
            why, "; it is filled by the stream's next version"));
        continue;
      }
      target = static_cast<int32_t>(i);
      donor = p;
      st.bootstrap_tried[pi.id] = attempt;
    }
  }
  if (target < 0) return;
  // Planning may take a while on a large model: outside the lock.
  absl::StatusOr<std::shared_ptr<const StreamPlan>> donor_plan =
      BuildDonorPlan(sp, donor, target);
  absl::MutexLock lock(&mu_);
  if (!DeliveryBlockedLocked(stream).empty()) {
    bootstrap_deferred_.insert(stream);
    return;
  }
  if (driver_->StreamOf(stream).latest_committed != version) {
    bootstrap_wanted_.insert(stream);  // a newer version: look again now
    return;
  }
  if (!donor_plan.ok()) {
    v1::InstanceStatus& s = driver_->RecordOf(sp.instances[target].id);
    s.set_instance_id(sp.instances[target].id);
    s.set_waiting_reason(absl::StrCat(
        "behind the stream's latest committed version ", version,
        "; no bootstrap from ", sp.instances[donor].id, ": ",
        donor_plan.status().message()));
    return;
  }
  StartDeliveryLocked(*std::move(donor_plan), RunKind::kBootstrap,
                      sp.instances[donor].id, version);
  // Another late instance may follow once this one settles.
  bootstrap_deferred_.insert(stream);
}

absl::StatusOr<v1::InstanceStatus> DonorDeliveries::ReloadInPlace(
    const std::string& stream, const std::string& instance_id,
    const Expired& expired) {
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  const StreamPlan& sp = **plan;
  const int32_t target = sp.FindInstance(instance_id);
  if (target < 0) {
    return absl::NotFoundError(absl::StrCat(
        "ReloadInPlace(", instance_id, "): stream ", stream,
        " has no complete instance ", instance_id,
        " (every tp rank registered)"));
  }
  if (!sp.instances[target].error.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ReloadInPlace(", instance_id, "): ", sp.instances[target].error));
  }
  int32_t donor = -1;
  int64_t version = 0;
  {
    absl::MutexLock lock(&mu_);
    if (driver_->Offloaded(instance_id)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ReloadInPlace(", instance_id, "): the instance is offloaded; "
          "Lifecycle.Onload brings it back"));
    }
    const std::string blocked = DeliveryBlockedLocked(stream);
    if (!blocked.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("ReloadInPlace(", instance_id, "): ", blocked));
    }
    version = driver_->StreamOf(stream).latest_committed;
    std::string why;
    donor = ChooseDonorLocked(sp, target, version, &why);
    if (donor < 0) {
      return absl::FailedPreconditionError(
          absl::StrCat("ReloadInPlace(", instance_id, "): ", why));
    }
  }
  absl::StatusOr<std::shared_ptr<const StreamPlan>> donor_plan =
      BuildDonorPlan(sp, donor, target);
  if (!donor_plan.ok()) {
    return absl::Status(donor_plan.status().code(),
                        absl::StrCat("ReloadInPlace(", instance_id, "): ",
                                     donor_plan.status().message()));
  }
  absl::MutexLock lock(&mu_);
  const std::string blocked = DeliveryBlockedLocked(stream);
  if (!blocked.empty() ||
      driver_->StreamOf(stream).latest_committed != version) {
    return absl::FailedPreconditionError(absl::StrCat(
        "ReloadInPlace(", instance_id, "): ",
        blocked.empty() ? absl::StrCat("version ", version,
                                       " was superseded while planning")
                        : blocked));
  }
  std::shared_ptr<VersionRun> run =
      StartDeliveryLocked(*std::move(donor_plan), RunKind::kReload,
                          sp.instances[donor].id, version);
  // The delivery has deadlines (acks, the version timeout), so this ends.
  while (!run->settled) {
    if (expired && expired()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ReloadInPlace(", instance_id, "): the call's deadline passed "
          "before the reload settled; ListStreams shows its outcome"));
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
  return driver_->Status(*run, run->instances[0]);
}

v1::PeerDelivery DonorDeliveries::InfoLocked(const VersionRun& run) const {
  v1::PeerDelivery d;
  const InstanceRun& inst = run.instances[0];
  d.set_kind(RunKindName(run.kind));
  d.set_instance_id(inst.id);
  d.set_peer_instance_id(run.donor);
  d.set_version(run.version);
  *d.mutable_status() = driver_->Status(run, inst);
  d.set_bytes_moved(inst.progress->bytes_moved.load());
  d.set_bytes_total(inst.progress->bytes_total.load());
  const absl::Time end = run.settled ? run.settled_at : absl::Now();
  d.set_elapsed_ms(absl::ToInt64Milliseconds(end - run.begun_at));
  if (d.bytes_moved() > 0 && run.first_byte_at != absl::InfiniteFuture()) {
    const double seconds = absl::ToDoubleSeconds(end - run.first_byte_at);
    d.set_throughput_bytes_per_second(seconds > 0 ? d.bytes_moved() / seconds
                                                  : 0);
  }
  d.set_settled(run.settled);
  return d;
}

void DonorDeliveries::DeliveryLoop() {
  while (true) {
    std::set<std::string> streams;
    {
      absl::MutexLock lock(&mu_);
      while (!stopping_ && bootstrap_wanted_.empty()) changed_.Wait(&mu_);
      if (stopping_) return;
      streams.swap(bootstrap_wanted_);
      bootstrap_checking_ = streams;
    }
    for (const std::string& stream : streams) BootstrapStream(stream);
    absl::MutexLock lock(&mu_);
    bootstrap_checking_.clear();
    changed_.SignalAll();
  }
}

}  // namespace ferry
