// VersionCoordinator, the rank event channel: each destination rank's
// outbox of update events (PREPARE, PAUSE, APPLY, COMMIT, ABORT) with ids,
// the events kept for acks and re-subscription, the RPCs that read and
// answer it (Subscribe, Ack), and each channel's staging as the transfer
// queue reserves and reads it.
#include "daemon/versions/version_coordinator.h"

#include <algorithm>
#include <iterator>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {

namespace {

// Sent events kept per rank, for acks and a rank that subscribes again.
constexpr size_t kSentEventsKept = 256;

}  // namespace

RankChannel& VersionCoordinator::ChannelLocked(
    const Participant& p) {
  RankChannel& c = channels_[p.channel_id()];
  if (c.staging == nullptr) {
    const bool gpu_rank = p.memory != nullptr && p.memory->mapped() &&
                          p.memory->any_on_device();
    // A GPU rank that asked for device staging gets it on its own GPU
    // (unless ferryd runs with --nodevice_staging); other GPU ranks get
    // pinned host staging; host ranks plain host staging.
    const int gpu = gpu_rank && p.device_staging && options_.device_staging
                        ? p.memory->first_gpu()
                        : -1;
    c.staging = std::make_shared<StagingArea>(
        absl::StrCat(p.instance_id, ".", p.tp_rank),
        gpu_rank ? options_.devices : nullptr, gpu);
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
  if (p.adapter != nullptr) event.set_adapter_name(p.adapter->name);
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
  // A new event of the instance (COMMIT and ABORT too) ends whatever the
  // rank was asked for it before; other instances' asks (the base model's,
  // each adapter's) stand.
  for (auto it = c.awaiting.begin(); it != c.awaiting.end();) {
    it = it->second.instance == inst.id ? c.awaiting.erase(it) : std::next(it);
  }
  if (needs_ack) {
    c.awaiting[id] = RankChannel::Awaiting{inst.id, event};
    inst.waiting_event[tp_rank] = id;
  }
  c.outbox.push_back(std::move(event));
  if (c.sink != nullptr) c.sink->Wake();
}

void VersionCoordinator::Send(VersionRun& run, InstanceRun& inst,
                              v1::UpdateEventKind kind,
                              const EventDetail& detail) {
  inst.waiting_kind = kind;
  inst.waiting_event.assign(inst.ranks.size(), 0);
  inst.ack_deadline = clock_->Now() + options_.ack_timeout;
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    v1::UpdateEvent e;
    e.set_kind(kind);
    if (detail) detail(*inst.ranks[r], &e);
    PostLocked(run, inst, r, std::move(e), /*needs_ack=*/true);
  }
}

void VersionCoordinator::Apply(VersionRun& run, InstanceRun& inst) {
  const StreamPlan& plan = *run.plan;
  const PlannedInstance& planned = plan.instances[inst.planned];
  inst.waiting_kind = v1::UPDATE_EVENT_KIND_APPLY;
  inst.waiting_event.assign(inst.ranks.size(), 0);
  inst.ack_deadline = clock_->Now() + options_.ack_timeout;
  for (size_t r = 0; r < inst.ranks.size(); ++r) {
    if (inst.ranks[r]->removed.load()) continue;
    const RankChannel& c = ChannelLocked(*inst.ranks[r]);
    v1::UpdateEvent e;
    e.set_kind(v1::UPDATE_EVENT_KIND_APPLY);
    v1::ApplyDetail* apply = e.mutable_apply();
    if (const AdapterBinding* a = inst.ranks[r]->adapter.get()) {
      // An adapter's shares, in its own staging (adapters.h), on
      // this node or the engine rank's member.
      AdapterApply(*a, apply);
      PostLocked(run, inst, r, std::move(e), /*needs_ack=*/true);
      continue;
    }
    if (r < inst.remote_apply.size()) {
      *apply = inst.remote_apply[r];  // staging on the rank's own node
      PostLocked(run, inst, r, std::move(e), /*needs_ack=*/true);
      continue;
    }
    // A refill from the host copy restored the loader's tensors too.
    if (planned.resolved != nullptr && !run.from_host_copy) {
      for (const FallbackTensor& f : planned.resolved->ranks[r].fallback) {
        const ParamSpec spec = FallbackSpec(plan.model, f);
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
        ", ", UpdateEventKindName(ack.kind()), "): no such event was sent to this rank"));
  }
  RankChannel& c = cit->second;
  RankChannel::SentEvent& sent = c.sent[ack.event_id()];
  if (sent.version != ack.version() || sent.kind != ack.kind()) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": Ack for event ", ack.event_id(), " says version ",
        ack.version(), " ", UpdateEventKindName(ack.kind()), " but event ",
        ack.event_id(), " is version ", sent.version, " ",
        UpdateEventKindName(sent.kind)));
  }
  if (!sent.needs_ack) {
    return absl::FailedPreconditionError(
        absl::StrCat(who, ": event ", ack.event_id(), " (",
                     UpdateEventKindName(sent.kind), ") needs no ack"));
  }
  if (sent.ack_status != 0) {
    if (sent.ack_status == ack.status()) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": event ", ack.event_id(), " was already acked with another "
        "status"));
  }
  std::shared_ptr<VersionRun> run =
      FindRunBySerialLocked(sent.stream, sent.run_serial);
  InstanceRun* inst = nullptr;
  size_t index = 0;
  if (run != nullptr) {
    for (size_t i = 0; i < run->instances.size(); ++i) {
      if (run->instances[i].id == sent.instance) {
        inst = &run->instances[i];
        index = i;
      }
    }
  }
  if (inst == nullptr || inst->phase == RunPhase::kAborted) {
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
  c.awaiting.erase(ack.event_id());
  if (ack.status() == v1::ACK_STATUS_FAILED) {
    Abort(
        *run, *inst, AbortCause::kRankFailed,
        absl::StrCat("tp rank ", tp, " failed ", UpdateEventKindName(sent.kind),
                     ": ", ack.error_message()));
    Advance(run);
    return absl::OkStatus();
  }
  // An OK ack moves only its own instance (a fleet's version has 3,072
  // of them; every instance's status was rebuilt on each).
  AdvanceOne(run, index);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> VersionCoordinator::OpenSubscription(
    const std::shared_ptr<const Participant>& destination, EventSink* sink) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return absl::UnavailableError("ferryd is shutting down");
  if (destination->removed.load()) {
    return absl::NotFoundError(absl::StrCat(
        "participant ", destination->id, " is no longer registered"));
  }
  RankChannel& c = ChannelLocked(*destination);
  EndSubscriptionLocked(c, absl::CancelledError(
                               "replaced by a newer Subscribe for the same "
                               "participant"));
  c.subscription = ++c.subscriptions;
  c.sink = sink;
  // What the rank was asked and has not answered goes first, oldest
  // first, unless it is still queued.
  std::set<uint64_t> queued;
  for (const auto& e : c.outbox) queued.insert(e.event_id());
  for (auto it = c.awaiting.rbegin(); it != c.awaiting.rend(); ++it) {
    if (!queued.count(it->first)) c.outbox.push_front(it->second.event);
  }
  if (!c.outbox.empty()) sink->Wake();
  return c.subscription;
}

std::optional<v1::UpdateEvent> VersionCoordinator::NextEvent(
    const std::string& channel_id, uint64_t generation) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(channel_id);
  if (it == channels_.end()) return std::nullopt;
  RankChannel& c = it->second;
  if (c.subscription != generation || c.outbox.empty()) return std::nullopt;
  v1::UpdateEvent event = std::move(c.outbox.front());
  c.outbox.pop_front();
  return event;
}

void VersionCoordinator::CloseSubscription(
    const std::string& channel_id, uint64_t generation,
    std::vector<v1::UpdateEvent> unsent) {
  absl::MutexLock lock(&mu_);
  auto it = channels_.find(channel_id);
  if (it == channels_.end()) return;
  RankChannel& c = it->second;
  for (auto e = unsent.rbegin(); e != unsent.rend(); ++e) {
    c.outbox.push_front(std::move(*e));
  }
  if (c.subscription == generation) {
    c.subscription = 0;
    c.sink = nullptr;
  }
}

void VersionCoordinator::EndSubscriptionLocked(RankChannel& c,
                                               const absl::Status& why) {
  if (c.sink == nullptr) return;
  EventSink* sink = c.sink;
  c.sink = nullptr;
  c.subscription = 0;
  sink->End(why);
}

StagingArea& VersionCoordinator::StagingOf(const Participant& rank) {
  mu_.AssertHeld();  // the transfer queue calls with its lock, mu_, held
  return *ChannelLocked(rank).staging;
}

std::shared_ptr<StagingArea> VersionCoordinator::FindStaging(
    const std::string& participant_id) {
  mu_.AssertHeld();
  auto it = channels_.find(participant_id);
  return it == channels_.end() ? nullptr : it->second.staging;
}

int64_t VersionCoordinator::StagingReserved() const {
  mu_.AssertHeld();
  int64_t held = 0;
  for (const auto& [id, c] : channels_) {
    if (c.staging != nullptr) held += c.staging->reserved_bytes();
  }
  return held;
}

int64_t VersionCoordinator::StagingBytesInUse() const {
  absl::MutexLock lock(&mu_);
  return StagingReserved();
}

}  // namespace ferry
