#include "daemon/version_coordinator.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/region_copy.h"
#include "proto/convert.h"
#include "glog/logging.h"

namespace ferry {
namespace {

constexpr size_t kSentEventsKept = 256;

const char* KindName(v1::UpdateEventKind kind) {
  switch (kind) {
    case v1::UPDATE_EVENT_KIND_PREPARE:
      return "PREPARE";
    case v1::UPDATE_EVENT_KIND_PAUSE:
      return "PAUSE";
    case v1::UPDATE_EVENT_KIND_APPLY:
      return "APPLY";
    case v1::UPDATE_EVENT_KIND_COMMIT:
      return "COMMIT";
    case v1::UPDATE_EVENT_KIND_ABORT:
      return "ABORT";
    default:
      return "UNKNOWN";
  }
}

}  // namespace

VersionCoordinator::VersionCoordinator(const Options& options,
                                       PlanCache* plans,
                                       LocalExecutor* executor)
    : options_(options), plans_(plans), executor_(executor) {
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
  transfer_thread_ = std::thread([this] { TransferLoop(); });
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
}

void VersionCoordinator::Shutdown(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      shutting_down_ = true;
      const absl::Time deadline = absl::Now() + drain;
      auto busy = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (const auto& [name, s] : streams_) {
          if (s.current != nullptr) return true;
        }
        return false;
      };
      while (busy() && absl::Now() < deadline) {
        changed_.WaitWithDeadline(&mu_, deadline);
      }
      std::vector<std::shared_ptr<VersionRun>> runs;
      for (auto& [name, s] : streams_) {
        if (s.current != nullptr) runs.push_back(s.current);
      }
      for (auto& run : runs) AbortRunLocked(*run, "ferryd is shutting down");
      // Transfers notice the cancel flag between buckets.
      const absl::Time hard = absl::Now() + absl::Seconds(10);
      while (busy() && absl::Now() < hard) {
        changed_.WaitWithDeadline(&mu_, hard);
      }
      stopping_ = true;
      changed_.SignalAll();
    }
  }
  if (transfer_thread_.joinable()) transfer_thread_.join();
  if (deadline_thread_.joinable()) deadline_thread_.join();
}

// ---------------------------------------------------------------------------
// Events

VersionCoordinator::RankChannel& VersionCoordinator::ChannelLocked(
    const Participant& p) {
  RankChannel& c = channels_[p.id];
  if (c.staging == nullptr) {
    const bool gpu_rank = p.memory != nullptr && p.memory->mapped() &&
                          p.memory->any_on_device();
    c.staging = std::make_shared<StagingArea>(
        absl::StrCat(p.instance_id, ".", p.tp_rank),
        gpu_rank ? options_.devices : nullptr);
  }
  return c;
}

void VersionCoordinator::PostLocked(VersionRun& run, InstanceRun& inst,
                                    size_t tp_rank, v1::UpdateEvent event,
                                    bool needs_ack) {
  const Participant& p = *inst.ranks[tp_rank];
  if (p.removed.load()) return;
  RankChannel& c = ChannelLocked(p);
  const uint64_t id = c.next_event_id++;
  event.set_event_id(id);
  event.set_stream(run.stream);
  event.set_version(run.version);
  event.set_ack_timeout_ms(
      needs_ack ? absl::ToInt64Milliseconds(options_.ack_timeout) : 0);
  RankChannel::SentEvent sent;
  sent.version = run.version;
  sent.kind = event.kind();
  sent.needs_ack = needs_ack;
  sent.stream = run.stream;
  sent.instance = inst.id;
  sent.run_serial = run.serial;
  c.sent[id] = sent;
  while (c.sent.size() > kSentEventsKept) c.sent.erase(c.sent.begin());
  if (needs_ack) {
    c.awaiting_ack = id;
    c.awaiting_event = event;
    inst.waiting_event[tp_rank] = id;
  } else if (c.awaiting_ack != 0) {
    // COMMIT or ABORT ends whatever the rank was asked before.
    c.awaiting_ack = 0;
  }
  c.outbox.push_back(std::move(event));
}

void VersionCoordinator::SendToAllLocked(VersionRun& run, InstanceRun& inst,
                                         v1::UpdateEventKind kind) {
  inst.waiting_kind = kind;
  inst.waiting_event.assign(inst.ranks.size(), 0);
  inst.ack_deadline = absl::Now() + options_.ack_timeout;
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    v1::UpdateEvent e;
    e.set_kind(kind);
    PostLocked(run, inst, r, std::move(e), /*needs_ack=*/true);
  }
}

void VersionCoordinator::SendApplyLocked(VersionRun& run, InstanceRun& inst) {
  const StreamPlan& plan = *run.plan;
  const PlannedInstance& planned = plan.instances[inst.planned];
  inst.waiting_kind = v1::UPDATE_EVENT_KIND_APPLY;
  inst.waiting_event.assign(inst.ranks.size(), 0);
  inst.ack_deadline = absl::Now() + options_.ack_timeout;
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    if (inst.ranks[r]->removed.load()) continue;
    const RankChannel& c = ChannelLocked(*inst.ranks[r]);
    v1::UpdateEvent e;
    e.set_kind(v1::UPDATE_EVENT_KIND_APPLY);
    v1::ApplyDetail* apply = e.mutable_apply();
    if (r < inst.remote_apply.size()) {
      *apply = inst.remote_apply[r];  // staging on the rank's own node
      PostLocked(run, inst, r, std::move(e), /*needs_ack=*/true);
      continue;
    }
    if (planned.resolved != nullptr) {
      for (const FallbackTensor& f : planned.resolved->ranks[r].fallback) {
        const ParamSpec& spec = plan.model.params[f.param];
        const StagingArea::Slot* slot = c.staging->Find(spec.name);
        if (slot == nullptr) continue;  // reserved at Begin; cannot happen
        v1::FallbackTensor* t = apply->add_fallback_tensors();
        t->set_parameter(spec.name);
        t->set_dtype(DTypeToProto(spec.dtype));
        for (int64_t d : spec.shape) t->add_shape(d);
        t->set_region_id(slot->region_id);
        t->set_byte_offset(0);
        t->set_size_bytes(slot->bytes);
      }
    }
    for (v1::MemoryRegion& region : c.staging->Exported()) {
      *apply->add_staging_regions() = std::move(region);
    }
    PostLocked(run, inst, r, std::move(e), /*needs_ack=*/true);
  }
}

absl::Status VersionCoordinator::ReserveStagingLocked(const VersionRun& run,
                                                      const InstanceRun& inst) {
  const StreamPlan& plan = *run.plan;
  const PlannedInstance& planned = plan.instances[inst.planned];
  std::vector<std::vector<std::pair<std::string, int64_t>>> needs(
      inst.ranks.size());
  int64_t wanted = 0, held_here = 0, fresh = 0;
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    if (planned.resolved != nullptr) {
      for (const FallbackTensor& f : planned.resolved->ranks[r].fallback) {
        const ParamSpec& spec = plan.model.params[f.param];
        const int64_t bytes = BoxBytes(FullBox(spec.shape), spec.dtype);
        needs[r].emplace_back(spec.name, bytes);
        wanted += bytes;
      }
    }
    const StagingArea& area = *ChannelLocked(*inst.ranks[r]).staging;
    held_here += area.reserved_bytes();
    fresh += area.NewBytes(needs[r]);
  }
  // The limit is on all staging together: what the other instances hold
  // plus what this one needs (its own slots are replaced, not added).
  int64_t held = 0;
  for (const auto& [id, c] : channels_) {
    if (c.staging != nullptr) held += c.staging->reserved_bytes();
  }
  const int64_t others = held - held_here;
  if (wanted > max_staging_bytes_ - others) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "instance ", inst.id, " needs ", wanted,
        " bytes of staging for its fallback tensors in version ", run.version,
        "; with the ", others, " bytes other instances hold, that is over "
        "ferryd's staging limit of ", max_staging_bytes_,
        " bytes (--max_staging_mb)"));
  }
  // Shared memory is allocated as it is written: a segment larger than
  // /dev/shm's free space would fault the transfer, not fail here.
  struct statvfs fs;
  if (fresh > 0 && ::statvfs("/dev/shm", &fs) == 0) {
    const int64_t free_bytes = static_cast<int64_t>(fs.f_bavail) * fs.f_frsize;
    if (fresh > free_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "instance ", inst.id, " needs ", fresh,
          " more bytes of staging in version ", run.version,
          " but /dev/shm has ", free_bytes, " bytes free"));
    }
  }
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    absl::Status s = ChannelLocked(*inst.ranks[r]).staging->Reserve(needs[r]);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tp rank ", r, ": ",
                                                 s.message()));
    }
  }
  return absl::OkStatus();
}

// ---------------------------------------------------------------------------
// State changes

void VersionCoordinator::AbortInstanceLocked(VersionRun& run,
                                             InstanceRun& inst,
                                             const std::string& reason) {
  if (inst.settled()) return;
  inst.dirty = inst.was_dirty || inst.phase == Phase::kTransfer ||
               inst.phase == Phase::kApply;
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

void VersionCoordinator::AbortRunLocked(VersionRun& run,
                                        const std::string& reason) {
  if (run.settled) return;
  if (!run.aborted) {
    run.aborted = true;
    run.abort_reason = reason;
  }
  for (InstanceRun& inst : run.instances) {
    AbortInstanceLocked(run, inst, reason);
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
            SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_PAUSE);
          }
        }
        break;
      case Phase::kPause:
        if (all_acked(inst)) {
          inst.phase = Phase::kPaused;
          inst.ack_deadline = absl::InfiniteFuture();
          transfers_.push_back(TransferTicket{run, i, absl::Now()});
        }
        break;
      case Phase::kApply:
        if (all_acked(inst)) {
          inst.phase = Phase::kCommitted;
          inst.dirty = false;
          inst.ack_deadline = absl::InfiniteFuture();
          for (size_t r = 0; r < inst.ranks.size(); ++r) {
            v1::UpdateEvent e;
            e.set_kind(v1::UPDATE_EVENT_KIND_COMMIT);
            PostLocked(*run, inst, r, std::move(e), /*needs_ack=*/false);
          }
          if (checksums_ != nullptr) {
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
  StreamState& st = streams_[run.stream];
  if (st.current.get() == &run) {
    st.history.push_back(std::move(st.current));
    st.current = nullptr;
    while (st.history.size() > options_.history) st.history.pop_front();
  }
  LOG(INFO) << "stream " << run.stream << " version " << run.version
            << " settled" << (run.aborted ? " (aborted: " + run.abort_reason + ")" : "");
  changed_.SignalAll();
}

v1::InstanceStatus VersionCoordinator::StatusLocked(
    const VersionRun& run, const InstanceRun& inst) const {
  v1::InstanceStatus s;
  s.set_instance_id(inst.id);
  s.set_version(run.version);
  switch (inst.phase) {
    case Phase::kPrepare:
    case Phase::kPause:
      s.set_state(v1::INSTANCE_STATE_PREPARE);
      break;
    case Phase::kPaused:
      s.set_state(v1::INSTANCE_STATE_PAUSED);
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

// ---------------------------------------------------------------------------
// Versions RPCs

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
  for (size_t i = 0; i < sp.instances.size(); ++i) {
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
    }
    if (pi.plan_index >= 0) {
      inst.progress->bytes_total.store(
          sp.direct_plan().instances[pi.plan_index].bytes);
    }
    run->instances.push_back(std::move(inst));
  }
  st.current = run;
  st.last_begun = version;
  LOG(INFO) << "stream " << stream << ": version " << version << " begun by rank "
            << source->rank << " for " << run->instances.size()
            << " instances";

  for (InstanceRun& inst : run->instances) {
    const PlannedInstance& pi = sp.instances[inst.planned];
    std::string lost;
    for (const auto& r : inst.ranks) {
      if (r->removed.load()) lost = absl::StrCat("tp rank ", r->tp_rank,
                                                 " is no longer registered");
    }
    if (!lost.empty()) {
      AbortInstanceLocked(*run, inst, lost);
    } else if (!pi.error.empty()) {
      AbortInstanceLocked(*run, inst, pi.error);
    } else {
      absl::Status s = ReserveStagingLocked(*run, inst);
      if (!s.ok()) {
        // The code leads the reason: an outcome carries no status code.
        AbortInstanceLocked(*run, inst,
                            absl::StrCat(absl::StatusCodeToString(s.code()),
                                         ": ", s.message()));
      } else {
        inst.phase = Phase::kPrepare;
        SendToAllLocked(*run, inst, v1::UPDATE_EVENT_KIND_PREPARE);
      }
    }
    SyncRecordLocked(*run, inst);
  }
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
      run->deadline = absl::Now() + options_.version_timeout;
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
  AbortRunLocked(*run, absl::StrCat("AbortVersion by source rank ",
                                    source.rank, ": ", reason));
  while (!run->settled) changed_.WaitWithTimeout(&mu_, absl::Seconds(1));
  return OutcomeLocked(*run);
}

absl::Status VersionCoordinator::Ack(const Participant& destination,
                                     const v1::AckRequest& ack) {
  const std::string who = destination.Describe();
  if (ack.status() != v1::ACK_STATUS_OK &&
      ack.status() != v1::ACK_STATUS_FAILED) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": Ack status is required (OK or FAILED)"));
  }
  if (ack.status() == v1::ACK_STATUS_FAILED && ack.error_message().empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": a FAILED ack needs error_message"));
  }
  absl::MutexLock lock(&mu_);
  auto cit = channels_.find(destination.id);
  const RankChannel::SentEvent* found = nullptr;
  if (cit != channels_.end()) {
    auto sit = cit->second.sent.find(ack.event_id());
    if (sit != cit->second.sent.end()) found = &sit->second;
  }
  if (found == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": Ack for event ", ack.event_id(), " (version ", ack.version(),
        ", ", KindName(ack.kind()), "): no such event was sent to this rank"));
  }
  RankChannel& c = cit->second;
  RankChannel::SentEvent& sent = c.sent[ack.event_id()];
  if (sent.version != ack.version() || sent.kind != ack.kind()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": Ack for event ", ack.event_id(), " says version ",
        ack.version(), " ", KindName(ack.kind()), " but event ",
        ack.event_id(), " is version ", sent.version, " ",
        KindName(sent.kind)));
  }
  if (!sent.needs_ack) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": event ", ack.event_id(), " (",
                     KindName(sent.kind), ") needs no ack"));
  }
  if (sent.ack_status != 0) {
    if (sent.ack_status == ack.status()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": event ", ack.event_id(), " was already acked with another "
        "status"));
  }
  std::shared_ptr<VersionRun> run = FindRunLocked(sent.stream, sent.version);
  InstanceRun* inst = nullptr;
  if (run != nullptr && run->serial == sent.run_serial) {
    for (InstanceRun& i : run->instances) {
      if (i.id == sent.instance) inst = &i;
    }
  }
  if (inst == nullptr || inst->phase == Phase::kAborted) {
    return absl::AbortedError(absl::StrCat(
        who, ": version ", sent.version, " was aborted for instance ",
        sent.instance,
        inst != nullptr ? absl::StrCat(": ", inst->abort_reason) : ""));
  }
  sent.ack_status = ack.status();
  const size_t tp = destination.tp_rank;
  if (tp < inst->waiting_event.size() &&
      inst->waiting_event[tp] == ack.event_id()) {
    inst->waiting_event[tp] = 0;
  }
  if (c.awaiting_ack == ack.event_id()) c.awaiting_ack = 0;
  if (ack.status() == v1::ACK_STATUS_FAILED) {
    AbortInstanceLocked(*run, *inst,
                        absl::StrCat("tp rank ", tp, " failed ",
                                     KindName(sent.kind), ": ",
                                     ack.error_message()));
  }
  AdvanceLocked(run);
  return absl::OkStatus();
}

absl::Status VersionCoordinator::Subscribe(
    const std::shared_ptr<const Participant>& destination,
    const std::function<bool(const v1::UpdateEvent&)>& write,
    const std::function<bool()>& cancelled) {
  const std::string id = destination->id;
  absl::MutexLock lock(&mu_);
  if (destination->removed.load()) {
    return absl::NotFoundError(
        absl::StrCat("participant ", id, " is no longer registered"));
  }
  uint64_t generation;
  {
    RankChannel& c = ChannelLocked(*destination);
    generation = ++c.subscriptions;
    c.subscription = generation;  // an older stream sees this and ends
    if (c.awaiting_ack != 0) {
      bool queued = false;
      for (const auto& e : c.outbox) queued |= e.event_id() == c.awaiting_ack;
      if (!queued) c.outbox.push_front(c.awaiting_event);
    }
    changed_.SignalAll();
  }
  while (true) {
    if (stopping_) return absl::UnavailableError("ferryd is shutting down");
    auto it = channels_.find(id);
    if (it == channels_.end() || destination->removed.load()) {
      return absl::NotFoundError(absl::StrCat(
          "participant ", id, ": registration ended"));
    }
    RankChannel& c = it->second;
    if (c.subscription != generation) {
      return absl::CancelledError(
          "replaced by a newer Subscribe for the same participant");
    }
    if (!c.outbox.empty()) {
      v1::UpdateEvent event = std::move(c.outbox.front());
      c.outbox.pop_front();
      mu_.Unlock();
      const bool ok = write(event);
      mu_.Lock();
      if (!ok) {
        auto again = channels_.find(id);
        if (again != channels_.end()) {
          again->second.outbox.push_front(std::move(event));
          if (again->second.subscription == generation) {
            again->second.subscription = 0;
          }
        }
        return absl::CancelledError("the client went away");
      }
      continue;
    }
    if (cancelled()) {
      if (c.subscription == generation) c.subscription = 0;
      return absl::CancelledError("the client cancelled Subscribe");
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
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

// ---------------------------------------------------------------------------
// Removal, deadlines, transfers

void VersionCoordinator::OnParticipantRemoved(const Participant& p,
                                              const std::string& why) {
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(p.stream);
  if (it != streams_.end() && it->second.current != nullptr) {
    std::shared_ptr<VersionRun> run = it->second.current;
    if (p.role == Role::kSource) {
      for (const auto& s : run->plan->sources) {
        if (s != nullptr && s->id == p.id) {
          AbortRunLocked(*run, absl::StrCat("source rank ", p.rank,
                                            " lost: ", why));
        }
      }
    } else {
      for (InstanceRun& inst : run->instances) {
        for (const auto& r : inst.ranks) {
          if (r->id == p.id) {
            AbortInstanceLocked(*run, inst,
                                absl::StrCat("tp rank ", p.tp_rank,
                                             " lost: ", why));
          }
        }
      }
      AdvanceLocked(run);
    }
  }
  channels_.erase(p.id);  // staging is freed once no transfer holds it
  changed_.SignalAll();
}

void VersionCoordinator::OnParticipantAdded(const Participant& p) {
  if (p.role != Role::kDestination) return;
  absl::MutexLock lock(&mu_);
  auto it = records_.find(p.instance_id);
  if (it == records_.end() ||
      it->second.committed_version() <= p.held_version) {
    return;
  }
  v1::InstanceStatus& s = it->second;
  LOG(INFO) << "instance " << p.instance_id << ": tp rank " << p.tp_rank
            << " registered holding version " << p.held_version
            << "; the instance no longer holds version "
            << s.committed_version();
  s.set_committed_version(p.held_version);
  if (s.state() != v1::INSTANCE_STATE_ABORTED) {
    s.set_state(v1::INSTANCE_STATE_IDLE);
    s.set_version(0);
  }
  changed_.SignalAll();
}

void VersionCoordinator::CheckDeadlinesLocked() {
  const absl::Time now = absl::Now();
  std::vector<std::shared_ptr<VersionRun>> runs;
  for (auto& [name, st] : streams_) {
    if (st.current != nullptr) runs.push_back(st.current);
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
      AbortInstanceLocked(
          *run, inst,
          absl::StrCat("tp rank", late.size() > 1 ? "s " : " ",
                       absl::StrJoin(late, ", "), " did not ack ",
                       KindName(inst.waiting_kind), " within ",
                       absl::ToInt64Milliseconds(options_.ack_timeout),
                       " ms"));
      changed = true;
    }
    if (now > run->deadline) {
      const std::string limit = absl::StrCat(
          absl::ToInt64Milliseconds(options_.version_timeout),
          " ms of the first CommitVersion");
      if (!run->all_committed()) {
        std::vector<int32_t> missing;
        for (int32_t r = 0; r < run->world_size; ++r) {
          if (!run->committed.count(r)) missing.push_back(r);
        }
        AbortRunLocked(*run, absl::StrCat("source ranks [",
                                          absl::StrJoin(missing, ", "),
                                          "] did not commit within ", limit));
      } else {
        for (InstanceRun& inst : run->instances) {
          if (inst.settled()) continue;
          AbortInstanceLocked(
              *run, inst,
              absl::StrCat("version timeout: not settled within ", limit,
                           " (state ",
                           v1::InstanceState_Name(
                               StatusLocked(*run, inst).state()),
                           ")"));
        }
      }
      changed = true;
    }
    if (changed) AdvanceLocked(run);
  }
}

void VersionCoordinator::DeadlineLoop() {
  absl::MutexLock lock(&mu_);
  while (!stopping_) {
    CheckDeadlinesLocked();
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(20));
  }
}

RankMemory VersionCoordinator::MemoryOfLocked(const StreamPlan& plan,
                                              int32_t planned,
                                              size_t tp_rank) {
  const PlannedInstance& pi = plan.instances[planned];
  const Participant& p = *pi.ranks[tp_rank];
  RankMemory m;
  m.client = p.memory;
  auto it = channels_.find(p.id);
  if (it == channels_.end()) return m;
  m.staging = it->second.staging;
  if (pi.resolved != nullptr) {
    for (const FallbackTensor& f : pi.resolved->ranks[tp_rank].fallback) {
      const StagingArea::Slot* slot =
          m.staging->Find(plan.model.params[f.param].name);
      m.staging_bases.push_back(slot == nullptr ? nullptr
                                                : slot->memory.data());
    }
  }
  return m;
}

bool VersionCoordinator::WaitsForRelayLocked(const TransferTicket& t) const {
  const VersionRun& run = *t.run;
  const InstanceRun& inst = run.instances[t.instance];
  if (run.settled || inst.phase != Phase::kPaused || inst.relay_failed) {
    return false;
  }
  const StreamPlan& plan = *run.plan;
  const int32_t relay_from =
      plan.plan.instances[plan.instances[inst.planned].plan_index].relay_from;
  if (relay_from < 0) return false;
  const int32_t from = plan.InstanceAtPlanIndex(relay_from);
  for (const InstanceRun& other : run.instances) {
    if (other.planned != from) continue;
    // One ready to transfer (its ranks paused) or transferring is waited
    // for; one still pausing for a short while only: a slow or stuck
    // replica must not keep this one paused (it reads the trainer then).
    if (other.phase == Phase::kPaused || other.phase == Phase::kTransfer) {
      return true;
    }
    return (other.phase == Phase::kPrepare || other.phase == Phase::kPause) &&
           absl::Now() < t.queued_at + options_.relay_wait;
  }
  return false;
}

void VersionCoordinator::TransferLoop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    // The first ticket that need not wait: a replica waits while the one
    // it relays from is about to land (WaitsForRelayLocked), so that it
    // relays (the trainer sends each byte once) instead of reading the
    // trainer again.
    auto ready = transfers_.end();
    while (!stopping_) {
      ready = std::find_if(transfers_.begin(), transfers_.end(),
                           [this](const TransferTicket& t) {
                             mu_.AssertHeld();
                             return !WaitsForRelayLocked(t);
                           });
      if (ready != transfers_.end()) break;
      if (transfers_.empty()) {
        changed_.Wait(&mu_);
      } else {  // every phase change signals; the timeout is a backstop
        changed_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
      }
    }
    if (stopping_) return;
    TransferTicket ticket = std::move(*ready);
    transfers_.erase(ready);
    VersionRun& run = *ticket.run;
    InstanceRun& inst = run.instances[ticket.instance];
    if (inst.phase != Phase::kPaused || run.settled) continue;
    const StreamPlan& plan = *run.plan;
    const PlannedInstance& pi = plan.instances[inst.planned];

    TransferJob job;
    job.plan = run.plan;
    job.instance = inst.planned;
    job.progress = inst.progress.get();
    // Relay from the replica the plan names only if its transfer landed,
    // and only between instances that each sit on one node (an instance
    // spread over nodes neither relays nor is relayed from). Within a node
    // the LocalExecutor relays everything; between nodes, or on a member,
    // RemoteTransfers relays live buffers only, so an instance with
    // fallback tensors there follows direct_plan. Otherwise: direct_plan.
    const int32_t relay_from = plan.plan.instances[pi.plan_index].relay_from;
    auto on_one_node = [](const PlannedInstance& x) {
      for (const auto& r : x.ranks) {
        if (r->node != x.ranks[0]->node) return false;
      }
      return true;
    };
    auto has_staging = [](const PlannedInstance& x) {
      for (const RankLayout& rank : *x.layout) {
        for (const Piece& p : rank.pieces) {
          if (p.buffer & kStagingBufferBit) return true;
        }
      }
      return false;
    };
    std::shared_ptr<const InstanceChecksums> relayed_sums;
    if (relay_from >= 0 && on_one_node(pi) && !inst.relay_failed) {
      const int32_t from = plan.InstanceAtPlanIndex(relay_from);
      const PlannedInstance& source = plan.instances[from];
      for (const InstanceRun& other : run.instances) {
        if (on_one_node(source) && other.planned == from &&
            other.transfer_clean &&
            (other.phase == Phase::kApply ||
             other.phase == Phase::kCommitted)) {
          job.relay = true;
          inst.relayed_from = source.id;
          relayed_sums = other.checksums;
          for (size_t r = 0; r < pi.ranks.size(); ++r) {
            job.relay_source.push_back(MemoryOfLocked(plan, from, r));
          }
        }
      }
    }
    bool remote = remote_ != nullptr && remote_->Handles(job);
    if (job.relay && remote && has_staging(pi)) {
      job.relay = false;
      inst.relayed_from.clear();
      job.relay_source.clear();
      remote = remote_->Handles(job);
    }
    for (size_t r = 0; r < pi.ranks.size(); ++r) {
      job.destination.push_back(MemoryOfLocked(plan, inst.planned, r));
    }
    inst.phase = Phase::kTransfer;
    SyncRecordLocked(run, inst);
    if (run.first_byte_at == absl::InfiniteFuture()) {
      run.first_byte_at = absl::Now();
    }
    ++run.transfers_in_flight;
    changed_.SignalAll();
    std::shared_ptr<TransferProgress> keep = inst.progress;
    std::vector<v1::ApplyDetail> remote_apply;
    if (remote) job.apply = &remote_apply;

    const std::string stream = run.stream, instance_id = inst.id;

    mu_.Unlock();
    const absl::Time start = absl::Now();
    // Source checksums are hashed while the bytes are copied.
    std::unique_ptr<TransferChecksums::Pending> hashing =
        checksums_ == nullptr
            ? nullptr
            : checksums_->Start(job, stream, run.version, instance_id,
                                std::move(relayed_sums));
    absl::Status s =
        remote ? remote_->Execute(job) : executor_->Execute(job);
    std::shared_ptr<const InstanceChecksums> sums =
        hashing == nullptr ? nullptr : hashing->Finish();
    const absl::Duration took = absl::Now() - start;
    mu_.Lock();

    --run.transfers_in_flight;
    if (inst.phase == Phase::kTransfer && !s.ok() && job.relay &&
        !absl::IsUnimplemented(s) && !run.aborted) {
      // The replica it relayed from failed under it (its node died, its
      // channel broke): this instance is not at fault, so it is fed from
      // the sources instead (direct_plan rewrites every byte), first in
      // the queue. A failure of that transfer aborts it.
      LOG(WARNING) << "stream " << run.stream << " version " << run.version
                   << ": instance " << inst.id << " relay from "
                   << inst.relayed_from << " failed (" << s.message()
                   << "); copying from the sources instead";
      inst.relay_failed = true;
      inst.relayed_from.clear();
      inst.was_dirty = true;  // the relay may have written some bytes
      inst.phase = Phase::kPaused;
      keep->bytes_moved.store(0);
      transfers_.push_front(TransferTicket{ticket.run, ticket.instance,
                                           absl::Now()});
      SyncRecordLocked(run, inst);
    } else if (inst.phase == Phase::kTransfer) {
      if (!s.ok()) {
        // Executors refuse what they cannot do (UNIMPLEMENTED) before any
        // byte moves: the live buffers still hold the previous version.
        if (absl::IsUnimplemented(s)) inst.phase = Phase::kPaused;
        AbortInstanceLocked(run, inst,
                            absl::StrCat("transfer failed: ", s.message()));
      } else {
        inst.transfer_clean = true;
        inst.checksums = std::move(sums);
        inst.remote_apply = std::move(remote_apply);
        inst.phase = Phase::kApply;
        SendApplyLocked(run, inst);
        LOG(INFO) << "stream " << run.stream << " version " << run.version
                  << ": instance " << inst.id << " transfer of "
                  << keep->bytes_moved.load() << " bytes"
                  << (job.relay ? " (relayed)" : "") << " in "
                  << absl::FormatDuration(took);
      }
    }
    AdvanceLocked(ticket.run);
  }
}

// ---------------------------------------------------------------------------
// Inspection

VersionCoordinator::StreamSummary VersionCoordinator::Summary(
    const std::string& stream) const {
  absl::MutexLock lock(&mu_);
  StreamSummary s;
  auto it = streams_.find(stream);
  if (it == streams_.end()) return s;
  s.latest_committed = it->second.latest_committed;
  s.in_progress =
      it->second.current == nullptr ? 0 : it->second.current->version;
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
  v1::GetProgressResponse out;
  out.set_stream(stream);
  out.set_version(run->version);
  const absl::Time end = run->settled ? run->settled_at : absl::Now();
  out.set_elapsed_ms(absl::ToInt64Milliseconds(end - run->begun_at));
  int64_t moved = 0, total = 0;
  for (const InstanceRun& inst : run->instances) {
    v1::InstanceProgress* ip = out.add_instances();
    *ip->mutable_status() = StatusLocked(*run, inst);
    ip->set_bytes_moved(inst.progress->bytes_moved.load());
    ip->set_bytes_total(inst.progress->bytes_total.load());
    ip->set_relayed_from(inst.relayed_from);
    moved += ip->bytes_moved();
    total += ip->bytes_total();
    if (inst.phase == Phase::kCommitted) {
      out.set_instances_committed(out.instances_committed() + 1);
    }
    if (inst.phase == Phase::kAborted) {
      out.set_instances_aborted(out.instances_aborted() + 1);
    }
  }
  out.set_instances_total(run->instances.size());
  out.set_bytes_moved(moved);
  out.set_bytes_total(total);
  if (moved > 0 && run->first_byte_at != absl::InfiniteFuture()) {
    const double seconds =
        absl::ToDoubleSeconds(end - run->first_byte_at);
    out.set_throughput_bytes_per_second(seconds > 0 ? moved / seconds : 0);
  }
  return out;
}

}  // namespace ferry
