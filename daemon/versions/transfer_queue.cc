// TransferQueue (transfer_queue.h): the staging reservation, the memory
// each job reads and writes, the order tickets run in (relays and
// exchanges wait for the replica they read), and the transfer workers,
// each a loop of steps: take the next ticket, prepare its job, execute it
// without the lock, and finish (APPLY, a retry from the sources, an
// exchange's second part, or an abort).
#include "daemon/versions/transfer_queue.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/piece.h"
#include "core/region_copy.h"
#include "glog/logging.h"

namespace ferry {

TransferQueue::TransferQueue(const Options& options, absl::Mutex& mu,
                             absl::CondVar& changed, Runs* runs,
                             LocalExecutor* executor)
    : options_(options),
      mu_(mu),
      changed_(changed),
      runs_(runs),
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

TransferQueue::~TransferQueue() { Join(); }

void TransferQueue::Start(RemoteExecutor* remote,
                          TransferChecksums* checksums) {
  remote_ = remote;
  checksums_ = checksums;
  for (int i = 0; i < std::max(1, options_.workers); ++i) {
    workers_.emplace_back([this] { Loop(); });
  }
}

void TransferQueue::StopLocked() { stopping_ = true; }

void TransferQueue::Join() {
  for (std::thread& t : workers_) {
    if (t.joinable()) t.join();
  }
}

void TransferQueue::PushLocked(TransferTicket ticket) {
  tickets_.push_back(std::move(ticket));
}

absl::Status TransferQueue::ReserveStagingLocked(const VersionRun& run,
                                                 const InstanceRun& inst) {
  const StreamPlan& plan = *run.plan;
  const PlannedInstance& planned = plan.instances[inst.planned];
  std::vector<std::vector<std::pair<std::string, int64_t>>> needs(
      inst.ranks.size());
  int64_t wanted = 0, held_here = 0, fresh = 0;
  auto on_this_node = [&](size_t r) {
    return options_.node.empty() || inst.ranks[r]->node == options_.node;
  };
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    if (!on_this_node(r)) continue;  // its member reserves it
    // An adapter's rank writes its own staging (adapters.h), never its
    // base rank's, which this would release.
    if (inst.ranks[r]->adapter != nullptr) continue;
    if (planned.resolved != nullptr) {
      for (const FallbackTensor& f : planned.resolved->ranks[r].fallback) {
        const ParamSpec spec = FallbackSpec(plan.model, f);
        const int64_t bytes = BoxBytes(FullBox(spec.shape), spec.dtype);
        needs[r].emplace_back(spec.name, bytes);
        wanted += bytes;
      }
    }
    const StagingArea& area = runs_->StagingOf(*inst.ranks[r]);
    held_here += area.reserved_bytes();
    fresh += area.NewBytes(needs[r]);
  }
  // The limit is on all staging together: what the other instances hold
  // plus what this one needs (its own slots are replaced, not added).
  const int64_t held = runs_->StagingReserved();
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
    if (!on_this_node(r) || inst.ranks[r]->adapter != nullptr) continue;
    absl::Status s = runs_->StagingOf(*inst.ranks[r]).Reserve(needs[r]);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tp rank ", r, ": ",
                                                 s.message()));
    }
  }
  return absl::OkStatus();
}

RankMemory TransferQueue::MemoryOfLocked(const StreamPlan& plan,
                                         int32_t planned, size_t tp_rank) {
  const PlannedInstance& pi = plan.instances[planned];
  const Participant& p = *pi.ranks[tp_rank];
  RankMemory m;
  m.client = p.memory;
  std::shared_ptr<StagingArea> staging = runs_->FindStaging(p.id);
  if (staging == nullptr || p.adapter != nullptr) return m;
  m.staging = std::move(staging);
  if (pi.resolved != nullptr) {
    for (const FallbackTensor& f : pi.resolved->ranks[tp_rank].fallback) {
      const StagingArea::Slot* slot =
          m.staging->Find(FallbackSpec(plan.model, f).name);
      m.staging_bases.push_back(slot == nullptr ? nullptr : slot->data());
    }
  }
  return m;
}

bool TransferQueue::WaitsForRelayLocked(const TransferTicket& t) const {
  const VersionRun& run = *t.run;
  const InstanceRun& inst = run.instances[t.instance];
  if (run.settled || inst.phase != RunPhase::kPaused || inst.replica_failed) {
    return false;
  }
  const StreamPlan& plan = *run.plan;
  const int32_t relay_from =
      plan.plan.instances[plan.instances[inst.planned].plan_index].relay_from;
  // A replica whose relay would not run reads the sources at once: it
  // has nothing to wait for (replicas that span nodes used to wait for
  // the one their plan names, and so moved one relay stage at a time).
  if (relay_from < 0 || !plan.RelayRuns(inst.planned, options_.node)) {
    return false;
  }
  const int32_t from = plan.InstanceAtPlanIndex(relay_from);
  for (const InstanceRun& other : run.instances) {
    if (other.planned != from) continue;
    // One ready to transfer (its ranks paused) or transferring is waited
    // for; one still pausing for a short while only: a slow or stuck
    // replica must not keep this one paused (it reads the trainer then).
    if (other.phase == RunPhase::kPaused ||
        other.phase == RunPhase::kTransfer) {
      return true;
    }
    return (other.phase == RunPhase::kPrepare ||
            other.phase == RunPhase::kPause) &&
           absl::Now() < t.queued_at + options_.relay_wait;
  }
  return false;
}

const InstanceRun* TransferQueue::PartnerLocked(
    const VersionRun& run, const InstanceRun& inst) const {
  const StreamPlan& plan = *run.plan;
  const Exchange* exchange =
      plan.ExchangeOf(plan.instances[inst.planned].plan_index);
  if (exchange == nullptr) return nullptr;
  const int32_t partner = plan.InstanceAtPlanIndex(exchange->partner);
  for (const InstanceRun& other : run.instances) {
    if (other.planned == partner) return &other;
  }
  return nullptr;
}

bool TransferQueue::WaitsForPartnerLocked(const TransferTicket& t) const {
  if (t.part != TransferJob::Part::kGiven) return false;
  const VersionRun& run = *t.run;
  const InstanceRun& inst = run.instances[t.instance];
  if (run.settled || inst.phase != RunPhase::kPaused || inst.replica_failed) {
    return false;
  }
  const InstanceRun* partner = PartnerLocked(run, inst);
  if (partner == nullptr || partner->first_part_landed ||
      partner->transfer_clean) {
    return false;
  }
  // As for a relay: one transferring (or paused, about to) is waited for,
  // one still pausing only for a short while.
  if (partner->phase == RunPhase::kPaused ||
      partner->phase == RunPhase::kTransfer) {
    return true;
  }
  return (partner->phase == RunPhase::kPrepare ||
          partner->phase == RunPhase::kPause) &&
         absl::Now() < t.queued_at + options_.relay_wait;
}

void TransferQueue::Loop() {
  absl::MutexLock lock(&mu_);
  while (true) {
    Flight f;
    if (!NextLocked(&f.ticket)) return;
    const VersionRun& run = *f.ticket.run;
    if (run.instances[f.ticket.instance].phase != RunPhase::kPaused ||
        run.settled) {
      continue;
    }
    PrepareLocked(f);
    ExecuteLocked(f);
    FinishLocked(f);
  }
}

bool TransferQueue::NextLocked(TransferTicket* ticket) {
  // The first ticket that need not wait: a replica waits while the one
  // it relays from is about to land (WaitsForRelayLocked), so that it
  // relays (the trainer sends each byte once) instead of reading the
  // trainer again.
  auto ready = tickets_.end();
  while (!stopping_) {
    ready = std::find_if(tickets_.begin(), tickets_.end(),
                         [this](const TransferTicket& t) {
                           mu_.AssertHeld();
                           return !WaitsForRelayLocked(t) &&
                                  !WaitsForPartnerLocked(t);
                         });
    if (ready != tickets_.end()) break;
    if (tickets_.empty()) {
      changed_.Wait(&mu_);
    } else {  // every phase change signals; the timeout is a backstop
      changed_.WaitWithTimeout(&mu_, absl::Milliseconds(50));
    }
  }
  if (stopping_) return false;
  *ticket = std::move(*ready);
  tickets_.erase(ready);
  return true;
}

void TransferQueue::PrepareLocked(Flight& f) {
  const TransferTicket& ticket = f.ticket;
  VersionRun& run = *ticket.run;
  InstanceRun& inst = run.instances[ticket.instance];
  const StreamPlan& plan = *run.plan;
  const PlannedInstance& pi = plan.instances[inst.planned];
  TransferJob& job = f.job;
  job.plan = run.plan;
  job.instance = inst.planned;
  job.run = run.serial;
  job.version = run.version;
  // Patches only into what a version left (a reload's memory is suspect).
  job.delta_base = run.kind == RunKind::kVersion ? inst.delta_base : 0;
  job.progress = inst.progress.get();
  // Relay from the replica the plan names only if its transfer landed,
  // and only between instances that each sit on one node (an instance
  // spread over nodes neither relays nor is relayed from). Within a node
  // the LocalExecutor relays everything; between nodes, or on a member,
  // RouteSender relays live buffers only, so an instance with
  // fallback tensors there reads the sources. Between two nodes, only
  // where the relay tree pays (core/relay_choice.h): replicas fed by many
  // trainer nodes read them at once. Otherwise: the sources, as
  // StreamPlan::DirectPlan says.
  const int32_t relay_from = plan.plan.instances[pi.plan_index].relay_from;
  if (ticket.part == TransferJob::Part::kAll && relay_from >= 0 &&
      !inst.replica_failed && plan.RelayRuns(inst.planned, options_.node)) {
    const int32_t from = plan.InstanceAtPlanIndex(relay_from);
    const PlannedInstance& source = plan.instances[from];
    for (const InstanceRun& other : run.instances) {
      if (other.planned == from &&
          other.transfer_clean &&
          (other.phase == RunPhase::kApply ||
           other.phase == RunPhase::kCommitted)) {
        job.relay = true;
        inst.relayed_from = source.id;
        f.relayed_sums = other.checksums;
        for (size_t r = 0; r < pi.ranks.size(); ++r) {
          job.relay_source.push_back(MemoryOfLocked(plan, from, r));
        }
      }
    }
  }
  // An exchange (core/exchange.h): first the buckets its partner does
  // not give it, from the sources; then, once the partner's first part
  // landed, the given ones from the partner (or from the sources, when
  // the partner cannot give them).
  if (ticket.part == TransferJob::Part::kGiven) {
    job.part = TransferJob::Part::kGiven;
    const InstanceRun* partner = PartnerLocked(run, inst);
    job.from_partner = !inst.replica_failed && partner != nullptr &&
                       partner->phase != RunPhase::kAborted &&
                       (partner->first_part_landed ||
                        partner->transfer_clean);
    inst.given_by = job.from_partner ? partner->id : "";
  } else if (!job.relay && !inst.replica_failed &&
             plan.ExchangeOf(pi.plan_index) != nullptr) {
    job.part = TransferJob::Part::kFirst;
  }
  bool remote = remote_ != nullptr && remote_->Handles(job);
  if (job.relay && remote && HasStagingPieces(*pi.layout)) {
    job.relay = false;
    inst.relayed_from.clear();
    job.relay_source.clear();
    remote = remote_->Handles(job);
  }
  for (size_t r = 0; r < pi.ranks.size(); ++r) {
    job.destination.push_back(MemoryOfLocked(plan, inst.planned, r));
  }
  inst.phase = RunPhase::kTransfer;
  if (ticket.part != TransferJob::Part::kGiven) {
    inst.transfer_started_at = absl::Now();
  }
  inst.remote_transfer = remote;
  runs_->Record(run, inst);
  if (run.first_byte_at == absl::InfiniteFuture()) {
    run.first_byte_at = absl::Now();
  }
  ++run.transfers_in_flight;
  changed_.SignalAll();
  f.progress = inst.progress;
  f.remote = remote;
  if (remote) job.apply = &f.remote_apply;
}

void TransferQueue::ExecuteLocked(Flight& f) {
  const VersionRun& run = *f.ticket.run;
  const std::string stream = run.stream;
  const std::string instance_id = run.instances[f.ticket.instance].id;
  const int64_t version = run.version;
  TransferJob& job = f.job;
  const bool remote = f.remote;

  mu_.Unlock();
  const absl::Time start = absl::Now();
  // FP8 in flight: the version's tensors quantized once, before the first
  // transfer that reads the sources (a relay or a partner's part reads an
  // instance that has them already), and before their bytes are hashed.
  absl::Status s;
  if (job.plan->fp8 != nullptr && !job.relay && !job.from_partner) {
    // A split tensor's amaxes come from the members that hold its parts.
    RemoteExecutor* remote_executor = remote_;
    s = job.plan->fp8->Quantize(
        job.run, [&job, remote_executor](const std::string& node,
                                         const std::vector<size_t>& tensors)
                     -> absl::StatusOr<std::vector<std::vector<uint32_t>>> {
          if (remote_executor == nullptr) {
            return absl::UnavailableError(absl::StrCat(
                "no route to member ", node, " (a daemon without members)"));
          }
          return remote_executor->PartialAmax(job, node, tensors);
        });
  }
  // Source checksums are hashed while the bytes are copied.
  // An exchange's first part hashes every bucket's sources (they hold
  // the version until it settles); its second part none.
  std::unique_ptr<TransferChecksums::Pending> hashing =
      checksums_ == nullptr || job.part == TransferJob::Part::kGiven
          ? nullptr
          : checksums_->Start(job, stream, version, instance_id,
                              std::move(f.relayed_sums));
  TransferExecutor& executor =
      remote ? static_cast<TransferExecutor&>(*remote_) : *executor_;
  if (s.ok()) s = executor.Execute(job);
  f.sums = hashing == nullptr ? nullptr : hashing->Finish(s.ok());
  f.status = std::move(s);
  f.took = absl::Now() - start;
  mu_.Lock();
}

void TransferQueue::FinishLocked(Flight& f) {
  VersionRun& run = *f.ticket.run;
  InstanceRun& inst = run.instances[f.ticket.instance];
  --run.transfers_in_flight;
  if (inst.phase == RunPhase::kTransfer && !f.status.ok() &&
      (f.job.relay || f.job.from_partner) && !run.aborted) {
    RetryFromSourcesLocked(f);
  } else if (inst.phase == RunPhase::kTransfer && f.status.ok() &&
             f.job.part == TransferJob::Part::kFirst) {
    FirstPartLandedLocked(f);
  } else if (inst.phase == RunPhase::kTransfer) {
    TransferEndedLocked(f);
  }
  runs_->Advance(f.ticket.run);
}

void TransferQueue::RetryFromSourcesLocked(Flight& f) {
  VersionRun& run = *f.ticket.run;
  InstanceRun& inst = run.instances[f.ticket.instance];
  // The replica it read failed under it (its node died, its channel
  // broke, its memory went away, a route refused): this instance is
  // not at fault, so what it was reading comes from the sources
  // instead, first in the queue (a relay's every byte, an exchange's
  // given buckets; what its first part moved stands). A failure of
  // that transfer aborts it.
  LOG(WARNING) << "stream " << run.stream << " version " << run.version
               << ": instance " << inst.id
               << (f.job.relay ? " relay from " : " exchange from ")
               << (f.job.relay ? inst.relayed_from : inst.given_by)
               << " failed (" << f.status.message()
               << "); copying those bytes from the sources instead";
  inst.replica_failed = true;
  inst.relayed_from.clear();
  inst.given_by.clear();
  inst.was_dirty = true;  // the read may have written some bytes
  inst.phase = RunPhase::kPaused;
  f.progress->bytes_moved.store(inst.first_part_bytes);
  tickets_.push_front(TransferTicket{f.ticket.run, f.ticket.instance,
                                     absl::Now(), f.ticket.part});
  runs_->Record(run, inst);
}

void TransferQueue::FirstPartLandedLocked(Flight& f) {
  VersionRun& run = *f.ticket.run;
  InstanceRun& inst = run.instances[f.ticket.instance];
  // The first part of an exchange landed: the partner may take what
  // it is given from here; the second part queues (first: this
  // instance is paused while it waits).
  inst.first_part_landed = true;
  inst.was_dirty = true;  // an abort before the second part: dirty
  inst.first_part_bytes = f.progress->bytes_moved.load();
  inst.first_part_sums = std::move(f.sums);
  inst.first_part_apply = std::move(f.remote_apply);
  inst.phase = RunPhase::kPaused;
  tickets_.push_front(TransferTicket{f.ticket.run, f.ticket.instance,
                                     absl::Now(),
                                     TransferJob::Part::kGiven});
  runs_->Record(run, inst);
}

void TransferQueue::TransferEndedLocked(Flight& f) {
  VersionRun& run = *f.ticket.run;
  InstanceRun& inst = run.instances[f.ticket.instance];
  const absl::Status& s = f.status;
  std::vector<v1::ApplyDetail>& remote_apply = f.remote_apply;
  if (f.job.part == TransferJob::Part::kGiven && s.ok()) {
    f.sums = std::move(inst.first_part_sums);
    // Each rank's APPLY detail from the part whose routes reached its
    // node (both reserve the same staging slots).
    remote_apply.resize(
        std::max(remote_apply.size(), inst.first_part_apply.size()));
    for (size_t r = 0; r < inst.first_part_apply.size(); ++r) {
      const v1::ApplyDetail& first = inst.first_part_apply[r];
      if (remote_apply[r].staging_regions().empty() &&
          remote_apply[r].fallback_tensors().empty()) {
        remote_apply[r] = first;
      }
    }
  }
  if (!s.ok()) {
    // Executors refuse what they cannot do (UNIMPLEMENTED) before any
    // byte moves: the live buffers still hold what they held (the
    // previous version, unless an exchange's first part landed:
    // was_dirty then says so).
    if (absl::IsUnimplemented(s)) inst.phase = RunPhase::kPaused;
    // A member out of staging for its ranks says so with its code.
    runs_->Abort(run, inst,
                 absl::IsResourceExhausted(s) ? AbortCause::kStaging
                                              : AbortCause::kTransfer,
                 absl::StrCat("transfer failed: ", s.message()));
    return;
  }
  inst.transfer_clean = true;
  inst.checksums = std::move(f.sums);
  inst.remote_apply = std::move(remote_apply);
  inst.phase = RunPhase::kApply;
  inst.transfer_done_at = absl::Now();
  runs_->Apply(run, inst);
  LOG(INFO) << "stream " << run.stream << " version " << run.version
            << ": instance " << inst.id << " transfer of "
            << f.progress->bytes_moved.load() << " bytes"
            << (f.job.relay ? " (relayed)" : "")
            << (inst.given_by.empty()
                    ? ""
                    : absl::StrCat(" (part given by ", inst.given_by, ")"))
            << " in " << absl::FormatDuration(f.took);
}

}  // namespace ferry
