// VersionCoordinator, the transfer queue: staging reserved for an
// instance's fallback tensors, the transfer workers that run tickets (each
// the first that need not wait: a replica that relays waits for the
// replica it relays from; independent instances run at once), and
// the memory each job reads and writes, and the staging held in all.
#include "daemon/versions/version_coordinator.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {

absl::Status VersionCoordinator::ReserveStagingLocked(const VersionRun& run,
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
    if (!on_this_node(r) || inst.ranks[r]->adapter != nullptr) continue;
    absl::Status s = ChannelLocked(*inst.ranks[r]).staging->Reserve(needs[r]);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("tp rank ", r, ": ",
                                                 s.message()));
    }
  }
  return absl::OkStatus();
}

RankMemory VersionCoordinator::MemoryOfLocked(const StreamPlan& plan,
                                              int32_t planned,
                                              size_t tp_rank) {
  const PlannedInstance& pi = plan.instances[planned];
  const Participant& p = *pi.ranks[tp_rank];
  RankMemory m;
  m.client = p.memory;
  auto it = channels_.find(p.id);
  if (it == channels_.end() || p.adapter != nullptr) return m;
  m.staging = it->second.staging;
  if (pi.resolved != nullptr) {
    for (const FallbackTensor& f : pi.resolved->ranks[tp_rank].fallback) {
      const StagingArea::Slot* slot =
          m.staging->Find(plan.model.params[f.param].name);
      m.staging_bases.push_back(slot == nullptr ? nullptr : slot->data());
    }
  }
  return m;
}

bool VersionCoordinator::WaitsForRelayLocked(const TransferTicket& t) const {
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
    if (other.phase == RunPhase::kPaused || other.phase == RunPhase::kTransfer) {
      return true;
    }
    return (other.phase == RunPhase::kPrepare || other.phase == RunPhase::kPause) &&
           absl::Now() < t.queued_at + options_.relay_wait;
  }
  return false;
}

const InstanceRun* VersionCoordinator::PartnerLocked(
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

bool VersionCoordinator::WaitsForPartnerLocked(const TransferTicket& t) const {
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
  if (partner->phase == RunPhase::kPaused || partner->phase == RunPhase::kTransfer) {
    return true;
  }
  return (partner->phase == RunPhase::kPrepare ||
          partner->phase == RunPhase::kPause) &&
         absl::Now() < t.queued_at + options_.relay_wait;
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
                             return !WaitsForRelayLocked(t) &&
                                    !WaitsForPartnerLocked(t);
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
    if (inst.phase != RunPhase::kPaused || run.settled) continue;
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
    // fallback tensors there reads the sources. Between two nodes, only
    // where the relay tree pays (core/relay_choice.h): replicas fed by many
    // trainer nodes read them at once. Otherwise: the sources, as
    // StreamPlan::DirectPlan says.
    const int32_t relay_from = plan.plan.instances[pi.plan_index].relay_from;
    std::shared_ptr<const InstanceChecksums> relayed_sums;
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
          relayed_sums = other.checksums;
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
    // An exchange's first part hashes every bucket's sources (they hold
    // the version until it settles); its second part none.
    std::unique_ptr<TransferChecksums::Pending> hashing =
        checksums_ == nullptr || job.part == TransferJob::Part::kGiven
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
    if (inst.phase == RunPhase::kTransfer && !s.ok() &&
        (job.relay || job.from_partner) && !run.aborted) {
      // The replica it read failed under it (its node died, its channel
      // broke, its memory went away, a route refused): this instance is
      // not at fault, so what it was reading comes from the sources
      // instead, first in the queue (a relay's every byte, an exchange's
      // given buckets; what its first part moved stands). A failure of
      // that transfer aborts it.
      LOG(WARNING) << "stream " << run.stream << " version " << run.version
                   << ": instance " << inst.id
                   << (job.relay ? " relay from " : " exchange from ")
                   << (job.relay ? inst.relayed_from : inst.given_by)
                   << " failed (" << s.message()
                   << "); copying those bytes from the sources instead";
      inst.replica_failed = true;
      inst.relayed_from.clear();
      inst.given_by.clear();
      inst.was_dirty = true;  // the read may have written some bytes
      inst.phase = RunPhase::kPaused;
      keep->bytes_moved.store(inst.first_part_bytes);
      transfers_.push_front(TransferTicket{ticket.run, ticket.instance,
                                           absl::Now(), ticket.part});
      SyncRecordLocked(run, inst);
    } else if (inst.phase == RunPhase::kTransfer && s.ok() &&
               job.part == TransferJob::Part::kFirst) {
      // The first part of an exchange landed: the partner may take what
      // it is given from here; the second part queues (first: this
      // instance is paused while it waits).
      inst.first_part_landed = true;
      inst.was_dirty = true;  // an abort before the second part: dirty
      inst.first_part_bytes = keep->bytes_moved.load();
      inst.first_part_sums = std::move(sums);
      inst.first_part_apply = std::move(remote_apply);
      inst.phase = RunPhase::kPaused;
      transfers_.push_front(TransferTicket{ticket.run, ticket.instance,
                                           absl::Now(),
                                           TransferJob::Part::kGiven});
      SyncRecordLocked(run, inst);
    } else if (inst.phase == RunPhase::kTransfer) {
      if (job.part == TransferJob::Part::kGiven && s.ok()) {
        sums = std::move(inst.first_part_sums);
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
        AbortInstanceLocked(run, inst,
                            absl::IsResourceExhausted(s) ? AbortCause::kStaging
                                                         : AbortCause::kTransfer,
                            absl::StrCat("transfer failed: ", s.message()));
      } else {
        inst.transfer_clean = true;
        inst.checksums = std::move(sums);
        inst.remote_apply = std::move(remote_apply);
        inst.phase = RunPhase::kApply;
        inst.transfer_done_at = absl::Now();
        SendApplyLocked(run, inst);
        LOG(INFO) << "stream " << run.stream << " version " << run.version
                  << ": instance " << inst.id << " transfer of "
                  << keep->bytes_moved.load() << " bytes"
                  << (job.relay ? " (relayed)" : "")
                  << (inst.given_by.empty()
                          ? ""
                          : absl::StrCat(" (part given by ", inst.given_by,
                                         ")"))
                  << " in "
                  << absl::FormatDuration(took);
      }
    }
    AdvanceLocked(ticket.run);
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
