// VersionCoordinator, the state machine every run goes through
// (version_coordinator.h lists its phases): an instance's entry and start,
// advancing on acks, aborting an instance or a whole run, settling, and the
// status each instance reports.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/versions/version_coordinator.h"
#include "glog/logging.h"

namespace ferry {

InstanceRun VersionCoordinator::NewInstanceRunLocked(
    const StreamPlan& sp, size_t i) {
  const PlannedInstance& pi = sp.instances[i];
  InstanceRun inst;
  inst.id = pi.id;
  inst.planned = static_cast<int32_t>(i);
  inst.ranks = pi.ranks;
  inst.waiting_event.assign(inst.ranks.size(), 0);
  inst.progress = std::make_shared<TransferProgress>();
  auto rec = records_.find(pi.id);
  if (rec == records_.end()) {
    v1::InstanceStatus fresh;
    fresh.set_instance_id(pi.id);
    fresh.set_state(v1::INSTANCE_STATE_IDLE);
    // Ranks may hold different versions (registry.h): the lowest.
    int64_t held = pi.ranks[0]->held_version;
    for (const auto& r : pi.ranks) held = std::min(held, r->held_version);
    fresh.set_committed_version(held);
    records_[pi.id] = fresh;
  } else {
    inst.was_dirty = rec->second.dirty();
    inst.delta_base =
        !rec->second.dirty() && rec->second.patch_base_plan() == sp.plan.digest
            ? rec->second.patch_base()
            : 0;
    // An offloaded instance is listed in a version and settles at once.
    if (rec->second.state() == v1::INSTANCE_STATE_OFFLOADED) {
      inst.phase = RunPhase::kOffloaded;
    }
  }
  if (pi.plan_index >= 0) {
    inst.progress->bytes_total.store(
        sp.plan.instances[pi.plan_index].bytes);
  }
  return inst;
}

void VersionCoordinator::StartInstance(VersionRun& run, InstanceRun& inst) {
  if (inst.phase == RunPhase::kOffloaded) {
    Record(run, inst);
    return;
  }
  const PlannedInstance& pi = run.plan->instances[inst.planned];
  std::string lost, released;
  for (const auto& r : inst.ranks) {
    if (r->removed.load()) {
      lost = absl::StrCat("tp rank ", r->tp_rank, " is no longer registered");
    } else if (r->memory != nullptr && r->memory->released()) {
      released = absl::StrCat(
          "tp rank ", r->tp_rank, " released its memory (Lifecycle.Offload) "
          "and did not register it again (Registry.UpdateRegions)");
    }
  }
  if (!lost.empty()) {
    Abort(run, inst, AbortCause::kRankLost, lost);
  } else if (!released.empty()) {
    Abort(run, inst, AbortCause::kPlan, released);
  } else if (!pi.error.empty()) {
    Abort(run, inst, AbortCause::kPlan, pi.error);
  } else {
    absl::Status s = ReserveStaging(run, inst);
    if (!s.ok()) {
      // The code leads the reason: an outcome carries no status code.
      Abort(
          run, inst, AbortCause::kStaging,
          absl::StrCat(absl::StatusCodeToString(s.code()), ": ", s.message()));
    } else {
      inst.phase = RunPhase::kPrepare;
      Send(run, inst, v1::UPDATE_EVENT_KIND_PREPARE, nullptr);
    }
  }
  Record(run, inst);
}

void VersionCoordinator::Advance(const std::shared_ptr<VersionRun>& run) {
  if (run->settled) return;
  for (size_t i = 0; i < run->instances.size(); ++i) AdvanceInstance(run, i);
  Settle(*run);
  changed_.SignalAll();
}

void VersionCoordinator::AdvanceOne(const std::shared_ptr<VersionRun>& run,
                                    size_t i) {
  if (run->settled) return;
  AdvanceInstance(run, i);
  Settle(*run);
  changed_.SignalAll();
}

void VersionCoordinator::AdvanceInstance(
    const std::shared_ptr<VersionRun>& shared, size_t i) {
  VersionRun& run = *shared;
  auto all_acked = [](const InstanceRun& inst) {
    for (uint64_t id : inst.waiting_event) {
      if (id != 0) return false;
    }
    return true;
  };
  {
    InstanceRun& inst = run.instances[i];
    switch (inst.phase) {
      case RunPhase::kPrepare:
        if (all_acked(inst)) {
          inst.ack_deadline = absl::InfiniteFuture();  // waits for sources
          if (run.all_committed()) {
            inst.phase = RunPhase::kPause;
            inst.pause_sent_at = absl::Now();
            Send(run, inst, v1::UPDATE_EVENT_KIND_PAUSE, nullptr);
          }
        }
        break;
      case RunPhase::kPause:
        if (all_acked(inst)) {
          inst.phase = RunPhase::kPaused;
          inst.paused_at = absl::Now();
          inst.ack_deadline = absl::InfiniteFuture();
          // An offload goes on in its Lifecycle call (offloads.cc).
          if (run.kind != RunKind::kOffload) {
            QueueTransfer(TransferTicket{shared, i, absl::Now()});
          }
        }
        break;
      case RunPhase::kOffload:
        if (all_acked(inst)) {
          inst.phase = RunPhase::kOffloaded;
          inst.ack_deadline = absl::InfiniteFuture();
          offloads_.AssertHeld();  // mu_ is its lock
          offloads_.FinishOffloadLocked(run, inst);
          LOG(INFO) << "stream " << run.stream << ": instance " << inst.id
                    << " OFFLOADED";
        }
        break;
      case RunPhase::kOnload:
        if (all_acked(inst)) {  // the refill goes on in its Lifecycle call
          inst.phase = RunPhase::kPaused;
          inst.ack_deadline = absl::InfiniteFuture();
        }
        break;
      case RunPhase::kUnload:
        if (all_acked(inst)) {  // every rank dropped the adapter
          inst.phase = RunPhase::kCommitted;
          inst.ack_deadline = absl::InfiniteFuture();
        }
        break;
      case RunPhase::kApply:
        if (all_acked(inst)) {
          inst.phase = RunPhase::kCommitted;
          inst.committed_at = absl::Now();
          inst.dirty = false;
          inst.ack_deadline = absl::InfiniteFuture();
          for (size_t r = 0; r < inst.ranks.size(); ++r) {
            v1::UpdateEvent e;
            e.set_kind(v1::UPDATE_EVENT_KIND_COMMIT);
            PostLocked(run, inst, r, std::move(e), /*needs_ack=*/false);
          }
          if (checksums_ != nullptr && !run.from_host_copy) {
            checksums_->Commit(inst.id, run.version, inst.checksums);
          }
          StreamState& st = streams_[run.stream];
          st.latest_committed = std::max(st.latest_committed, run.version);
          LOG(INFO) << "stream " << run.stream << " version "
                    << run.version << ": instance " << inst.id
                    << " COMMITTED";
        }
        break;
      default:
        break;
    }
    Record(run, inst);
  }
}

void VersionCoordinator::Settle(VersionRun& run) {
  if (run.settled || run.transfers_in_flight > 0) return;
  if (!run.aborted && !run.all_committed()) return;
  for (const InstanceRun& inst : run.instances) {
    if (!inst.settled()) return;
  }
  run.settled = true;
  run.settled_at = absl::Now();
  ReportSettledLocked(run);
  StreamState& st = streams_[run.stream];
  if (st.current.get() == &run) {
    st.history.push_back(std::move(st.current));
    st.current = nullptr;
    while (st.history.size() > options_.history) st.history.pop_front();
  } else if (st.delivery.get() == &run) {
    st.last_delivery = std::move(st.delivery);
    st.delivery = nullptr;
  }
  // A bootstrap that had to wait for this run (an instance registered
  // meanwhile) may start now.
  deliveries_.AssertHeld();  // mu_ is its lock
  deliveries_.RunSettledLocked(run.stream);
  LOG(INFO) << "stream " << run.stream << " version " << run.version
            << " settled" << (run.aborted ? " (aborted: " + run.abort_reason + ")" : "");
  // Last: a trainer rank that has its answer sees everything above done
  // (the metrics, the history, GetProgress).
  AnswerCommitsLocked(run);
  changed_.SignalAll();
}

void VersionCoordinator::AnswerCommitsLocked(VersionRun& run) {
  if (run.on_settled.empty()) return;
  std::vector<std::function<void(const VersionRun::Outcome&)>> waiting;
  waiting.swap(run.on_settled);
  VersionRun::Outcome outcome =
      run.aborted ? VersionRun::Outcome(absl::AbortedError(absl::StrCat(
                        "stream ", run.stream, " version ", run.version,
                        " was aborted: ", run.abort_reason)))
                  : VersionRun::Outcome(OutcomeLocked(run));
  for (auto& answer : waiting) answer(outcome);
}

void VersionCoordinator::Abort(VersionRun& run, InstanceRun& inst,
                               AbortCause cause, const std::string& reason) {
  if (inst.settled()) return;
  inst.abort_cause = cause;
  // Dirty: bytes may have been written, or (offload, onload) a rank may
  // hold no weights at all.
  inst.dirty = inst.was_dirty || inst.phase == RunPhase::kTransfer ||
               inst.phase == RunPhase::kApply ||
               inst.phase == RunPhase::kOffload || run.kind == RunKind::kOnload;
  inst.phase = RunPhase::kAborted;
  inst.abort_reason = reason;
  inst.waiting_event.assign(inst.ranks.size(), 0);
  inst.ack_deadline = absl::InfiniteFuture();
  if (inst.progress != nullptr) inst.progress->cancel.store(true);
  LOG(WARNING) << "stream " << run.stream << " version " << run.version
               << ": instance " << inst.id << " ABORTED"
               << (inst.dirty ? " (dirty)" : "") << ": " << reason;
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    v1::UpdateEvent e;
    e.set_kind(v1::UPDATE_EVENT_KIND_ABORT);
    e.mutable_abort()->set_reason(reason);
    e.mutable_abort()->set_dirty(inst.dirty);
    PostLocked(run, inst, r, std::move(e), /*needs_ack=*/false);
  }
  Record(run, inst);
}

void VersionCoordinator::AbortRunLocked(VersionRun& run, AbortCause cause,
                                        const std::string& reason) {
  if (run.settled) return;
  if (!run.aborted) {
    run.aborted = true;
    run.abort_reason = reason;
  }
  for (InstanceRun& inst : run.instances) {
    Abort(run, inst, cause, reason);
  }
  Settle(run);
  changed_.SignalAll();
}

v1::InstanceStatus VersionCoordinator::Status(const VersionRun& run,
                                              const InstanceRun& inst) const {
  v1::InstanceStatus s;
  s.set_instance_id(inst.id);
  if (!inst.ranks.empty() && inst.ranks[0] != nullptr &&
      inst.ranks[0]->adapter != nullptr) {
    s.set_base_instance_id(inst.ranks[0]->adapter->base_instance);
    s.set_adapter_name(inst.ranks[0]->adapter->name);
  }
  s.set_version(run.version);
  switch (inst.phase) {
    case RunPhase::kPrepare:
    case RunPhase::kPause:
      s.set_state(v1::INSTANCE_STATE_PREPARE);
      break;
    case RunPhase::kPaused:
    case RunPhase::kOffload:
    case RunPhase::kOnload:
    case RunPhase::kUnload:
      s.set_state(v1::INSTANCE_STATE_PAUSED);
      break;
    case RunPhase::kOffloaded:
      s.set_state(v1::INSTANCE_STATE_OFFLOADED);
      break;
    case RunPhase::kTransfer:
      s.set_state(v1::INSTANCE_STATE_TRANSFER);
      break;
    case RunPhase::kApply:
      s.set_state(v1::INSTANCE_STATE_APPLY);
      break;
    case RunPhase::kCommitted:
      s.set_state(v1::INSTANCE_STATE_COMMITTED);
      break;
    case RunPhase::kAborted:
      s.set_state(v1::INSTANCE_STATE_ABORTED);
      break;
  }
  s.set_dirty(inst.phase == RunPhase::kAborted ? inst.dirty : false);
  auto rec = records_.find(inst.id);
  s.set_committed_version(rec == records_.end() ? 0
                                                : rec->second.committed_version());
  if (inst.phase == RunPhase::kCommitted) s.set_committed_version(run.version);
  // Delta versions: what ferryd wrote whole stays a base until something
  // else writes there (docs/api.md, "Delta versions").
  if (inst.phase == RunPhase::kCommitted) {
    s.set_patch_base(run.version);
    s.set_patch_base_plan(run.plan->plan.digest);
  } else if (inst.phase != RunPhase::kOffloaded &&
             inst.phase != RunPhase::kOffload &&
             !(inst.phase == RunPhase::kAborted && inst.dirty) &&
             run.kind != RunKind::kReload && inst.delta_base > 0) {
    s.set_patch_base(inst.delta_base);
    s.set_patch_base_plan(run.plan->plan.digest);
  }
  s.set_abort_reason(inst.abort_reason);
  if (!inst.settled()) {
    for (size_t r = 0; r < inst.waiting_event.size(); ++r) {
      if (inst.waiting_event[r] != 0) s.add_waiting_on_tp_ranks(r);
    }
  }
  return s;
}

void VersionCoordinator::Record(const VersionRun& run,
                                const InstanceRun& inst) {
  records_[inst.id] = Status(run, inst);
}

std::vector<v1::InstanceStatus> VersionCoordinator::OutcomeLocked(
    const VersionRun& run) const {
  std::vector<v1::InstanceStatus> out;
  for (const InstanceRun& inst : run.instances) {
    out.push_back(Status(run, inst));
  }
  return out;
}

// RunDriver (run_driver.h), for the collaborators that run one kind of
// run (offload_runs.h); each is called with mu_ held.
std::shared_ptr<VersionRun> VersionCoordinator::StartSlotRun(
    std::shared_ptr<const StreamPlan> plan, int32_t target, RunKind kind,
    int64_t version, const std::string& donor) {
  mu_.AssertHeld();
  auto run = std::make_shared<VersionRun>();
  run->serial = next_run_serial_++;
  run->kind = kind;
  run->donor = donor;
  run->stream = plan->stream;
  run->version = version;
  run->plan = std::move(plan);
  run->world_size = 0;  // no source commits: none, or the donor holds it
  run->begun_at = absl::Now();
  run->deadline = clock_->Now() + options_.version_timeout;
  if (metrics_ != nullptr) {
    metrics_->VersionBegun(run->stream, RunKindName(kind));
  }
  run->instances.push_back(NewInstanceRunLocked(*run->plan, target));
  streams_[run->stream].delivery = run;
  return run;
}

void VersionCoordinator::WaitWhile(const VersionRun& run, RunPhase phase) {
  mu_.AssertHeld();
  // The phase's acks have deadlines (the deadline thread aborts what is
  // late), so this ends.
  while (!run.settled && run.instances[0].phase == phase) {
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
}

void VersionCoordinator::QueueTransfer(TransferTicket ticket) {
  transfers_.AssertHeld();  // mu_ is its lock, held by every caller
  transfers_.PushLocked(std::move(ticket));
}

absl::Status VersionCoordinator::ReserveStaging(const VersionRun& run,
                                                const InstanceRun& inst) {
  transfers_.AssertHeld();  // mu_ is its lock
  return transfers_.ReserveStagingLocked(run, inst);
}

}  // namespace ferry
