// VersionCoordinator (version_coordinator.h): its lifecycle, the version
// state machine (advance, abort, settle, outcomes) and the Versions RPCs
// that drive it (BeginVersion, CommitVersion, AbortVersion,
// WaitForVersion). The rank event channel, the transfer queue, deadlines
// and progress live in the files named after them.
#include "daemon/versions/version_coordinator.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/region_copy.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {

VersionCoordinator::VersionCoordinator(const Options& options,
                                       PlanCache* plans,
                                       LocalExecutor* executor)
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      plans_(plans),
      executor_(executor) {
  max_staging_bytes_ = options_.max_staging_bytes;
  if (max_staging_bytes_ < 0) {
    struct statvfs fs;
    max_staging_bytes_ =
        ::statvfs("/dev/shm", &fs) == 0
            ? static_cast<int64_t>(fs.f_blocks) * fs.f_frsize / 2
            : int64_t{1} << 30;
  }
}

VersionCoordinator::~VersionCoordinator() { Shutdown(absl::ZeroDuration()); }

void VersionCoordinator::Start() {
  RemoveStaleStaging();
  LOG(INFO) << "staging limit " << max_staging_bytes_ << " bytes";
  started_ = true;
  for (int i = 0; i < std::max(1, options_.transfer_workers); ++i) {
    transfer_threads_.emplace_back([this] { TransferLoop(); });
  }
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
  delivery_thread_ = std::thread([this] { DeliveryLoop(); });
}

void VersionCoordinator::Shutdown(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      shutting_down_ = true;
      const absl::Time deadline = absl::Now() + drain;
      auto busy = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (const auto& [name, s] : streams_) {
          if (s.current != nullptr || s.delivery != nullptr) return true;
        }
        return false;
      };
      while (busy() && absl::Now() < deadline) {
        changed_.WaitWithDeadline(&mu_, deadline);
      }
      std::vector<std::shared_ptr<VersionRun>> runs;
      for (auto& [name, s] : streams_) {
        if (s.current != nullptr) runs.push_back(s.current);
        if (s.delivery != nullptr) runs.push_back(s.delivery);
      }
      for (auto& run : runs) AbortRunLocked(*run, AbortCause::kShutdown, "ferryd is shutting down");
      // Transfers notice the cancel flag between buckets.
      const absl::Time hard = absl::Now() + absl::Seconds(10);
      while (busy() && absl::Now() < hard) {
        changed_.WaitWithDeadline(&mu_, hard);
      }
      stopping_ = true;
      changed_.SignalAll();
    }
  }
  for (std::thread& t : transfer_threads_) {
    if (t.joinable()) t.join();
  }
  if (deadline_thread_.joinable()) deadline_thread_.join();
  if (delivery_thread_.joinable()) delivery_thread_.join();
}

void VersionCoordinator::AbortInstanceLocked(VersionRun& run,
                                             InstanceRun& inst,
                                             AbortCause cause,
                                             const std::string& reason) {
  if (inst.settled()) return;
  inst.abort_cause = cause;
  // Dirty: bytes may have been written, or (offload, onload) a rank may
  // hold no weights at all.
  inst.dirty = inst.was_dirty || inst.phase == Phase::kTransfer ||
               inst.phase == Phase::kApply || inst.phase == Phase::kOffload ||
               run.kind == RunKind::kOnload;
  inst.phase = Phase::kAborted;
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
  SyncRecordLocked(run, inst);
}

void VersionCoordinator::AbortRunLocked(VersionRun& run, AbortCause cause,
                                        const std::string& reason) {
  if (run.settled) return;
  if (!run.aborted) {
    run.aborted = true;
    run.abort_reason = reason;
  }
  for (InstanceRun& inst : run.instances) {
    AbortInstanceLocked(run, inst, cause, reason);
  }
  MaybeSettleLocked(run);
  changed_.SignalAll();
}

void VersionCoordinator::AdvanceLocked(const std::shared_ptr<VersionRun>& run) {
  if (run->settled) return;
  auto all_acked = [](const InstanceRun& inst) {
    for (uint64_t id : inst.waiting_event) {
      if (id != 0) return false;
    }
    return true;
  };
  for (size_t i = 0; i < run->instances.size(); ++i) {
    InstanceRun& inst = run->instances[i];
    switch (inst.phase) {
      case Phase::kPrepare:
        if (all_acked(inst)) {
          inst.ack_deadline = absl::InfiniteFuture();  // waits for sources
          if (run->all_committed()) {
            inst.phase = Phase::kPause;
            inst.pause_sent_at = absl::Now();
            SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_PAUSE);
          }
        }
        break;
      case Phase::kPause:
        if (all_acked(inst)) {
          inst.phase = Phase::kPaused;
          inst.paused_at = absl::Now();
          inst.ack_deadline = absl::InfiniteFuture();
          // An offload goes on in its Lifecycle call (offloads.cc).
          if (run->kind != RunKind::kOffload) {
            transfers_.push_back(TransferTicket{run, i, absl::Now()});
          }
        }
        break;
      case Phase::kOffload:
        if (all_acked(inst)) {
          inst.phase = Phase::kOffloaded;
          inst.ack_deadline = absl::InfiniteFuture();
          FinishOffloadLocked(*run, inst);
          LOG(INFO) << "stream " << run->stream << ": instance " << inst.id
                    << " OFFLOADED";
        }
        break;
      case Phase::kOnload:
        if (all_acked(inst)) {  // the refill goes on in its Lifecycle call
          inst.phase = Phase::kPaused;
          inst.ack_deadline = absl::InfiniteFuture();
        }
        break;
      case Phase::kUnload:
        if (all_acked(inst)) {  // every rank dropped the adapter
          inst.phase = Phase::kCommitted;
          inst.ack_deadline = absl::InfiniteFuture();
        }
        break;
      case Phase::kApply:
        if (all_acked(inst)) {
          inst.phase = Phase::kCommitted;
          inst.committed_at = absl::Now();
          inst.dirty = false;
          inst.ack_deadline = absl::InfiniteFuture();
          for (size_t r = 0; r < inst.ranks.size(); ++r) {
            v1::UpdateEvent e;
            e.set_kind(v1::UPDATE_EVENT_KIND_COMMIT);
            PostLocked(*run, inst, r, std::move(e), /*needs_ack=*/false);
          }
          if (checksums_ != nullptr && !run->from_host_copy) {
            checksums_->Commit(inst.id, run->version, inst.checksums);
          }
          StreamState& st = streams_[run->stream];
          st.latest_committed = std::max(st.latest_committed, run->version);
          LOG(INFO) << "stream " << run->stream << " version "
                    << run->version << ": instance " << inst.id
                    << " COMMITTED";
        }
        break;
      default:
        break;
    }
    SyncRecordLocked(*run, inst);
  }
  MaybeSettleLocked(*run);
  changed_.SignalAll();
}

void VersionCoordinator::MaybeSettleLocked(VersionRun& run) {
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
  // meanwhile) may start now. Only then: planning the stream after every
  // version would cost a registry snapshot per version for nothing.
  if (bootstrap_deferred_.erase(run.stream) > 0) {
    bootstrap_wanted_.insert(run.stream);
  }
  LOG(INFO) << "stream " << run.stream << " version " << run.version
            << " settled" << (run.aborted ? " (aborted: " + run.abort_reason + ")" : "");
  changed_.SignalAll();
}

v1::InstanceStatus VersionCoordinator::StatusLocked(
    const VersionRun& run, const InstanceRun& inst) const {
  v1::InstanceStatus s;
  s.set_instance_id(inst.id);
  if (!inst.ranks.empty() && inst.ranks[0] != nullptr &&
      inst.ranks[0]->adapter != nullptr) {
    s.set_base_instance_id(inst.ranks[0]->adapter->base_instance);
    s.set_adapter_name(inst.ranks[0]->adapter->name);
  }
  s.set_version(run.version);
  switch (inst.phase) {
    case Phase::kPrepare:
    case Phase::kPause:
      s.set_state(v1::INSTANCE_STATE_PREPARE);
      break;
    case Phase::kPaused:
    case Phase::kOffload:
    case Phase::kOnload:
    case Phase::kUnload:
      s.set_state(v1::INSTANCE_STATE_PAUSED);
      break;
    case Phase::kOffloaded:
      s.set_state(v1::INSTANCE_STATE_OFFLOADED);
      break;
    case Phase::kTransfer:
      s.set_state(v1::INSTANCE_STATE_TRANSFER);
      break;
    case Phase::kApply:
      s.set_state(v1::INSTANCE_STATE_APPLY);
      break;
    case Phase::kCommitted:
      s.set_state(v1::INSTANCE_STATE_COMMITTED);
      break;
    case Phase::kAborted:
      s.set_state(v1::INSTANCE_STATE_ABORTED);
      break;
  }
  s.set_dirty(inst.phase == Phase::kAborted ? inst.dirty : false);
  auto rec = records_.find(inst.id);
  s.set_committed_version(rec == records_.end() ? 0
                                                : rec->second.committed_version());
  if (inst.phase == Phase::kCommitted) s.set_committed_version(run.version);
  s.set_abort_reason(inst.abort_reason);
  if (!inst.settled()) {
    for (size_t r = 0; r < inst.waiting_event.size(); ++r) {
      if (inst.waiting_event[r] != 0) s.add_waiting_on_tp_ranks(r);
    }
  }
  return s;
}

void VersionCoordinator::SyncRecordLocked(const VersionRun& run,
                                          const InstanceRun& inst) {
  records_[inst.id] = StatusLocked(run, inst);
}

std::vector<v1::InstanceStatus> VersionCoordinator::OutcomeLocked(
    const VersionRun& run) const {
  std::vector<v1::InstanceStatus> out;
  for (const InstanceRun& inst : run.instances) {
    out.push_back(StatusLocked(run, inst));
  }
  return out;
}

std::shared_ptr<VersionCoordinator::VersionRun>
VersionCoordinator::FindRunLocked(const std::string& stream,
                                  int64_t version) const {
  auto it = streams_.find(stream);
  if (it == streams_.end()) return nullptr;
  const StreamState& st = it->second;
  if (st.current != nullptr && st.current->version == version) {
    return st.current;
  }
  for (const auto& run : st.history) {
    if (run->version == version) return run;
  }
  return nullptr;
}

VersionCoordinator::InstanceRun VersionCoordinator::NewInstanceRunLocked(
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
    // An offloaded instance is listed in a version and settles at once.
    if (rec->second.state() == v1::INSTANCE_STATE_OFFLOADED) {
      inst.phase = Phase::kOffloaded;
    }
  }
  if (pi.plan_index >= 0) {
    inst.progress->bytes_total.store(
        sp.plan.instances[pi.plan_index].bytes);
  }
  return inst;
}

void VersionCoordinator::StartInstanceLocked(VersionRun& run,
                                             InstanceRun& inst) {
  if (inst.phase == Phase::kOffloaded) {
    SyncRecordLocked(run, inst);
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
    AbortInstanceLocked(run, inst, AbortCause::kRankLost, lost);
  } else if (!released.empty()) {
    AbortInstanceLocked(run, inst, AbortCause::kPlan, released);
  } else if (!pi.error.empty()) {
    AbortInstanceLocked(run, inst, AbortCause::kPlan, pi.error);
  } else {
    absl::Status s = ReserveStagingLocked(run, inst);
    if (!s.ok()) {
      // The code leads the reason: an outcome carries no status code.
      AbortInstanceLocked(run, inst, AbortCause::kStaging,
                          absl::StrCat(absl::StatusCodeToString(s.code()),
                                       ": ", s.message()));
    } else {
      inst.phase = Phase::kPrepare;
      SendToAllLocked(run, inst, v1::UPDATE_EVENT_KIND_PREPARE);
    }
  }
  SyncRecordLocked(run, inst);
}

std::shared_ptr<VersionCoordinator::VersionRun>
VersionCoordinator::FindRunBySerialLocked(const std::string& stream,
                                          uint64_t serial) const {
  auto it = streams_.find(stream);
  if (it == streams_.end()) return nullptr;
  const StreamState& st = it->second;
  for (const auto& run : {st.current, st.delivery, st.last_delivery}) {
    if (run != nullptr && run->serial == serial) return run;
  }
  for (const auto& run : st.history) {
    if (run->serial == serial) return run;
  }
  return nullptr;
}

absl::StatusOr<std::vector<std::string>> VersionCoordinator::BeginVersion(
    const std::shared_ptr<const Participant>& source, int64_t version,
    const Expired& expired) {
  const std::string& stream = source->stream;
  if (version <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream ", stream, ": BeginVersion(", version,
        ") from rank ", source->rank, ": versions are positive"));
  }
  // Planning may take a while on a large model: outside the lock.
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  if (expired && expired()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "stream ", stream, ": BeginVersion(", version, ") from rank ",
        source->rank, ": the call's deadline passed while planning; nothing "
        "was begun"));
  }

  absl::MutexLock lock(&mu_);
  if (shutting_down_) {
    return absl::UnavailableError("ferryd is shutting down");
  }
  StreamState& st = streams_[stream];
  // A peer delivery reads an instance that this version would overwrite:
  // the version waits for it to settle (it has deadlines of its own).
  while (st.delivery != nullptr && !shutting_down_) {
    if (expired && expired()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "stream ", stream, ": BeginVersion(", version, ") from rank ",
          source->rank, " waited for the ", DeliveryKindName(st.delivery->kind),
          " of instance ", st.delivery->instances[0].id, " from ",
          st.delivery->peer, ", which did not settle before the call's "
          "deadline; nothing was begun"));
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
  if (shutting_down_) {
    return absl::UnavailableError("ferryd is shutting down");
  }
  auto ids_of = [](const VersionRun& run) {
    std::vector<std::string> ids;
    for (const InstanceRun& inst : run.instances) ids.push_back(inst.id);
    return ids;
  };
  if (st.current != nullptr) {
    if (st.current->version != version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stream ", stream, ": BeginVersion(", version, ") from rank ",
          source->rank, " while version ", st.current->version,
          " is in progress; one version at a time"));
    }
    st.current->begun.insert(source->rank);  // joining, or a repeat
    return ids_of(*st.current);
  }
  if (version <= st.last_begun) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stream ", stream, ": BeginVersion(", version, ") from rank ",
        source->rank, ": version ", st.last_begun,
        " was begun before; versions must increase and are never reused"));
  }
  const StreamPlan& sp = **plan;
  // Sources incomplete (or not tiling the model): no version can start.
  if (!sp.source_error.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("BeginVersion(", version, "): ", sp.source_error));
  }
  for (const auto& s : sp.sources) {
    if (s == nullptr || s->removed.load()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stream ", stream, ": not every source rank is registered"));
    }
  }

  auto run = std::make_shared<VersionRun>();
  run->serial = next_run_serial_++;
  run->stream = stream;
  run->version = version;
  run->plan = *plan;
  run->world_size = static_cast<int32_t>(sp.sources.size());
  run->begun.insert(source->rank);
  run->begun_at = absl::Now();
  if (metrics_ != nullptr) metrics_->VersionBegun(run->stream, "version");
  for (size_t i = 0; i < sp.instances.size(); ++i) {
    if (RetiringAdapter(sp.instances[i])) continue;
    run->instances.push_back(NewInstanceRunLocked(sp, i));
  }
  st.current = run;
  st.last_begun = version;
  LOG(INFO) << "stream " << stream << ": version " << version << " begun by rank "
            << source->rank << " for " << run->instances.size()
            << " instances";

  for (InstanceRun& inst : run->instances) StartInstanceLocked(*run, inst);
  AdvanceLocked(run);
  return ids_of(*run);
}

absl::StatusOr<std::vector<v1::InstanceStatus>>
VersionCoordinator::CommitVersion(const Participant& source, int64_t version,
                                  const Expired& expired) {
  const std::string& stream = source.stream;
  absl::MutexLock lock(&mu_);
  std::shared_ptr<VersionRun> run = FindRunLocked(stream, version);
  if (run == nullptr) {
    auto it = streams_.find(stream);
    if (it != streams_.end() && it->second.current != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stream ", stream, ": CommitVersion(", version, ") from rank ",
          source.rank, " but version ", it->second.current->version,
          " is in progress"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("stream ", stream, ": CommitVersion(", version,
                     ") without BeginVersion(", version, ") from rank ",
                     source.rank));
  }
  if (!run->begun.count(source.rank)) {
    return absl::FailedPreconditionError(
        absl::StrCat("stream ", stream, ": CommitVersion(", version,
                     ") without BeginVersion(", version, ") from rank ",
                     source.rank));
  }
  if (!run->settled && !run->committed.count(source.rank)) {
    if (run->committed.empty()) {
      run->deadline = clock_->Now() + options_.version_timeout;
    }
    run->committed.insert(source.rank);
    AdvanceLocked(run);
  }
  // Every wait has a deadline: the deadline thread aborts what is late
  // (ack and version timeouts), so this loop ends; the caller's own
  // deadline may end it earlier.
  while (!run->settled) {
    if (expired && expired()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "stream ", stream, ": CommitVersion(", version, ") from rank ",
          source.rank, " counted, but the call's deadline passed before the "
          "version settled; WaitForVersion tells the outcome"));
    }
    changed_.WaitWithTimeout(&mu_, expired ? absl::Milliseconds(100)
                                           : absl::Seconds(1));
  }
  if (run->aborted) {
    return absl::AbortedError(absl::StrCat("stream ", stream, " version ",
                                           version, " was aborted: ",
                                           run->abort_reason));
  }
  return OutcomeLocked(*run);
}

absl::StatusOr<std::vector<v1::InstanceStatus>>
VersionCoordinator::AbortVersion(const Participant& source, int64_t version,
                                 const std::string& reason) {
  if (reason.empty()) {
    return absl::InvalidArgumentError("AbortVersion: reason is required");
  }
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(source.stream);
  if (it == streams_.end() || it->second.current == nullptr ||
      it->second.current->version != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("stream ", source.stream, ": AbortVersion(", version,
                     ") from rank ", source.rank,
                     ", but that version is not in progress"));
  }
  std::shared_ptr<VersionRun> run = it->second.current;
  AbortRunLocked(*run, AbortCause::kSourceAbort,
                 absl::StrCat("AbortVersion by source rank ",
                                    source.rank, ": ", reason));
  while (!run->settled) changed_.WaitWithTimeout(&mu_, absl::Seconds(1));
  return OutcomeLocked(*run);
}

absl::StatusOr<std::vector<v1::InstanceStatus>>
VersionCoordinator::WaitForVersion(const std::string& stream, int64_t version,
                                   const std::string& instance_id,
                                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end() || version > it->second.last_begun) {
    return absl::NotFoundError(absl::StrCat(
        "stream ", stream, " never began version ", version));
  }
  std::shared_ptr<VersionRun> run = FindRunLocked(stream, version);
  if (run == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "stream ", stream, ": this daemon keeps no record of version ",
        version, " (not begun, or too old)"));
  }
  std::vector<size_t> wanted;
  for (size_t i = 0; i < run->instances.size(); ++i) {
    if (instance_id.empty() || run->instances[i].id == instance_id) {
      wanted.push_back(i);
    }
  }
  if (!instance_id.empty() && wanted.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "instance ", instance_id, " does not take part in stream ", stream,
        " version ", version));
  }
  while (true) {
    std::vector<std::string> pending;
    for (size_t i : wanted) {
      const InstanceRun& inst = run->instances[i];
      if (!inst.settled()) {
        pending.push_back(absl::StrCat(
            inst.id, " (",
            v1::InstanceState_Name(StatusLocked(*run, inst).state()), ")"));
      }
    }
    if (pending.empty()) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "stream ", stream, " version ", version, ": still pending after ",
          absl::ToInt64Milliseconds(timeout), " ms: ",
          absl::StrJoin(pending, ", ")));
    }
    changed_.WaitWithDeadline(&mu_, deadline);
  }
  std::vector<v1::InstanceStatus> out;
  for (size_t i : wanted) out.push_back(StatusLocked(*run, run->instances[i]));
  return out;
}

void VersionCoordinator::ReportSettledLocked(const VersionRun& run) const {
  if (metrics_ == nullptr) return;
  const std::string kind = DeliveryKindName(run.kind);
  metrics_->VersionSettled(run.stream, kind, run.settled_at - run.begun_at);
  auto span = [](absl::Time from, absl::Time to) {
    return from == absl::InfiniteFuture() || to == absl::InfiniteFuture()
               ? absl::InfiniteDuration()
               : to - from;
  };
  for (const InstanceRun& inst : run.instances) {
    // Offloaded: it took no part (an offload's own run is counted).
    if (inst.phase == Phase::kOffloaded && run.kind != RunKind::kOffload) {
      continue;
    }
    DaemonMetrics::InstanceOutcome o;
    o.stream = run.stream;
    o.instance = inst.id;
    o.kind = kind;
    o.committed = inst.phase == Phase::kCommitted ||
                  inst.phase == Phase::kOffloaded;
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
    metrics_->InstanceSettled(o);
  }
}

int64_t VersionCoordinator::StagingBytesInUse() const {
  absl::MutexLock lock(&mu_);
  int64_t held = 0;
  for (const auto& [id, c] : channels_) {
    if (c.staging != nullptr) held += c.staging->reserved_bytes();
  }
  return held;
}

}  // namespace ferry
