// The Registry's membership: adding participants (Add, and
// ReplaceInstance for Lifecycle.SwapModel), the checks against the other
// ranks, replacing a rank's memory, authenticating and removing. Leases are
// in registry_leases.cc, adapter ranks in registry_adapters.cc, read-only
// views (snapshots, lists) in registry_views.cc; one class, one lock
// (registry.h).
#include "daemon/registry/registry.h"

#include <algorithm>
#include <optional>
#include <random>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "glog/logging.h"
#include "proto/request_limits.h"

namespace ferry {

std::string Registry::RandomToken() {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&out, absl::Hex(rd(), absl::kZeroPad8));
  return out;
}

Registry::Registry(absl::Duration lease, absl::Duration reaper_interval,
                   int64_t max_participants, const Clock* clock)
    : lease_(lease),
      max_participants_(max_participants),
      clock_(clock != nullptr ? clock : Clock::Real()),
      reaper_interval_(reaper_interval) {}

Registry::~Registry() { StopReaper(); }

void Registry::AddListener(Listener* listener) {
  listeners_.push_back(listener);
}

void Registry::NotifyRemoved(
    const std::vector<std::pair<std::shared_ptr<Participant>, std::string>>&
        removed) {
  for (const auto& [p, why] : removed) {
    LOG(INFO) << "removed " << p->Describe() << " (" << p->id << "): " << why;
    for (Listener* l : listeners_) l->OnParticipantRemoved(*p, why);
  }
}

void Registry::DeclareLocked(const Participant& p, Stream* s) {
  if (++s->lists[p.params.get()] > 1) return;  // its names are declared
  for (const ParamSpec& spec : *p.params) {
    auto [it, added] = s->declared.try_emplace(spec.name);
    if (added) {
      it->second.dtype = spec.dtype;
      it->second.shape = spec.shape;
      s->model_bytes += BoxBytes(FullBox(spec.shape), spec.dtype);
    }
    ++it->second.lists;
  }
}

void Registry::UndeclareLocked(const Participant& p, Stream* s) {
  auto list = s->lists.find(p.params.get());
  if (list == s->lists.end()) return;  // never declared
  if (--list->second > 0) return;     // other ranks still hold the list
  s->lists.erase(list);
  for (const ParamSpec& spec : *p.params) {
    auto it = s->declared.find(spec.name);
    if (it == s->declared.end() || --it->second.lists > 0) continue;
    s->model_bytes -= BoxBytes(FullBox(spec.shape), spec.dtype);
    s->declared.erase(it);
  }
}

std::shared_ptr<Participant> Registry::EraseLocked(const std::string& id) {
  auto it = participants_.find(id);
  std::shared_ptr<Participant> p = std::move(it->second.participant);
  participants_.erase(it);
  p->removed.store(true);
  auto sit = streams_.find(p->stream);
  if (sit == streams_.end()) return p;
  Stream& s = sit->second;
  s.epoch = NextEpochLocked();
  if (p->role == Role::kSource) {
    s.sources.erase(p->rank);
    UndeclareLocked(*p, &s);
    if (s.sources.empty()) s.world_size = 0;
  } else {
    auto inst = s.instances.find(p->instance_id);
    if (inst != s.instances.end()) {
      inst->second.erase(p->tp_rank);
      if (inst->second.empty()) {
        s.instances.erase(inst);
        instance_stream_.erase(p->instance_id);
        instance_options_.erase(p->instance_id);
      }
    }
  }
  // A stream with nobody left is gone (ListStreams no longer shows it).
  if (s.sources.empty() && s.instances.empty()) streams_.erase(sit);
  return p;
}

absl::Status Registry::CheckSourceLocked(const Participant& p,
                                         const Stream& s,
                                         const std::string& replaced) const {
  const bool others = !s.sources.empty() &&
                      !(s.sources.size() == 1 && !replaced.empty());
  if (others && s.world_size != p.world_size) {
    for (const auto& [rank, id] : s.sources) {
      if (id == replaced) continue;
      const Participant& other = *participants_.at(id).participant;
      return absl::InvalidArgumentError(absl::StrCat(
          p.Describe(), ": world_size ", p.world_size, " disagrees with rank ",
          other.rank, "'s world_size ", other.world_size));
    }
  }
  // A list a source here holds: every name in it is declared as it says
  // (each was checked or added when that source declared it, and an entry
  // changes only once no source declares it).
  if (s.lists.contains(p.params.get())) return absl::OkStatus();
  // The participant being replaced, and the names it declares (built only
  // if a declaration it may hold alone disagrees).
  const Participant* old =
      replaced.empty() ? nullptr : participants_.at(replaced).participant.get();
  std::unique_ptr<absl::flat_hash_set<absl::string_view>> old_names;
  for (const ParamSpec& mine : *p.params) {
    auto it = s.declared.find(mine.name);
    if (it == s.declared.end()) continue;
    const Declared& theirs = it->second;
    if (mine.dtype == theirs.dtype && mine.shape == theirs.shape) continue;
    // The replaced rank alone declares it: one list names it, and only
    // that rank holds the list.
    auto old_list =
        old == nullptr ? s.lists.end() : s.lists.find(old->params.get());
    if (theirs.lists == 1 && old_list != s.lists.end() &&
        old_list->second == 1) {
      if (old_names == nullptr) {
        old_names = std::make_unique<absl::flat_hash_set<absl::string_view>>();
        for (const ParamSpec& o : *old->params) old_names->insert(o.name);
      }
      if (old_names->contains(mine.name)) continue;  // it alone declares it
    }
    // Which rank declares it (the error path only: a scan).
    int32_t other_rank = -1;
    for (const auto& [rank, id] : s.sources) {
      if (id == replaced) continue;
      for (const ParamSpec& o : *participants_.at(id).participant->params) {
        if (o.name == mine.name) other_rank = rank;
      }
      if (other_rank >= 0) break;
    }
    return absl::InvalidArgumentError(absl::StrCat(
        p.Describe(), ": parameter ", mine.name, " declared as ",
        DTypeName(mine.dtype), " ", DimsToString(mine.shape), " but rank ",
        other_rank, " declares it as ", DTypeName(theirs.dtype), " ",
        DimsToString(theirs.shape)));
  }
  return absl::OkStatus();
}

absl::Status Registry::CheckDestinationLocked(
    const Participant& p, const Stream* s,
    const std::vector<std::string>& needed) const {
  if (s == nullptr) return absl::OkStatus();
  auto inst = s->instances.find(p.instance_id);
  if (inst != s->instances.end()) {
    for (const auto& [tp, id] : inst->second) {
      if (tp == p.tp_rank) continue;
      const Participant& other = *participants_.at(id).participant;
      if (other.tp_size != p.tp_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            p.Describe(), ": tp_size ", p.tp_size, " disagrees with tp rank ",
            other.tp_rank, "'s tp_size ", other.tp_size));
      }
      // held_version may differ between ranks: a restarted rank holds the
      // base weights while the others hold a later version, and ranks that
      // registered again after their daemon died may have seen different
      // COMMITs. The instance counts as holding the lowest (Snapshot).
      break;
    }
  }
  // With every source registered the stream's model is known: a name it
  // does not declare is an error now rather than at the next version.
  if (s->world_size > 0 &&
      static_cast<int32_t>(s->sources.size()) == s->world_size) {
    for (const std::string& name : needed) {
      if (!s->declared.contains(name)) {
        return absl::InvalidArgumentError(
            absl::StrCat(p.Describe(), ": checkpoint parameter ", name,
                         " is not declared by stream ", p.stream));
      }
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<const Participant>> Registry::Add(
    std::unique_ptr<Participant> participant, bool replace_existing) {
  std::shared_ptr<Participant> p(std::move(participant));
  if (p->engine_table) {
    p->engine_params = tables_.Intern(ShareParts(p->engine_params, &parts_));
  }
  if (p->role == Role::kSource) p->params = declarations_.Intern(p->params);
  std::vector<std::pair<std::shared_ptr<Participant>, std::string>> removed;
  // Outside the lock: what a destination needs from its stream.
  const std::vector<std::string> needed =
      p->role == Role::kDestination ? p->NeededNames()
                                    : std::vector<std::string>();
  {
    // Under the lock only lookups, one per parameter or name, and the
    // insertion: parsing, mapping and validation were done by the caller.
    absl::MutexLock lock(&mu_);
    auto sit = streams_.find(p->stream);
    Stream* s = sit == streams_.end() ? nullptr : &sit->second;
    std::string existing;  // participant id holding the same rank
    if (p->role == Role::kSource) {
      if (s != nullptr) {
        auto it = s->sources.find(p->rank);
        if (it != s->sources.end()) existing = it->second;
        if (!existing.empty() && !replace_existing) {
          return absl::AlreadyExistsError(absl::StrCat(
              p->Describe(), " is already registered (participant ",
              existing, "); pass replace_existing to take it over"));
        }
        absl::Status st = CheckSourceLocked(*p, *s, existing);
        if (!st.ok()) return st;
      }
    } else {
      auto owner = instance_stream_.find(p->instance_id);
      if (owner != instance_stream_.end() && owner->second != p->stream) {
        return absl::AlreadyExistsError(absl::StrCat(
            "instance ", p->instance_id, " already follows stream ",
            owner->second, "; instance ids are unique across streams"));
      }
      absl::Status st = CheckDestinationLocked(*p, s, needed);
      if (!st.ok()) return st;
      if (s != nullptr) {
        auto inst = s->instances.find(p->instance_id);
        if (inst != s->instances.end()) {
          auto it = inst->second.find(p->tp_rank);
          if (it != inst->second.end()) existing = it->second;
        }
      }
    }
    if (existing.empty() &&
        static_cast<int64_t>(participants_.size()) >= max_participants_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          p->Describe(), ": this daemon holds ", participants_.size(),
          " participants, the most it takes (docs/api.md, \"Limits\"); "
          "deregister ranks that are gone, or let their leases expire"));
    }
    if (!existing.empty()) {
      if (!replace_existing) {
        return absl::AlreadyExistsError(absl::StrCat(
            p->Describe(), " is already registered (participant ", existing,
            "); pass replace_existing to take it over"));
      }
      EraseWithAdaptersLocked(existing, "replaced by a new registration",
                              &removed);
    }
    const uint64_t serial = next_serial_++;
    p->id = p->role == Role::kSource
                ? absl::StrCat("src.", p->stream, ".", p->rank, ".",
                               absl::Hex(serial, absl::kZeroPad4))
                : absl::StrCat("dst.", p->instance_id, ".", p->tp_rank, ".",
                               absl::Hex(serial, absl::kZeroPad4));
    p->token = RandomToken();
    p->registered_at = absl::Now();
    Stream& stream = streams_[p->stream];  // again: the erase may remove it
    stream.epoch = NextEpochLocked();
    if (p->role == Role::kSource) {
      stream.world_size = p->world_size;
      stream.sources[p->rank] = p->id;
      DeclareLocked(*p, &stream);
      if (static_cast<int32_t>(stream.sources.size()) == stream.world_size) {
        auto model = std::make_shared<std::vector<ParamSpec>>();
        for (const auto& [name, d] : stream.declared) {
          model->push_back(ParamSpec{name, d.dtype, d.shape});
        }
        // In name order, the model's (plan_cache.cc): sorted once here,
        // when the world completes, not again on every plan.
        std::sort(model->begin(), model->end(),
                  [](const ParamSpec& a, const ParamSpec& b) {
                    return a.name < b.name;
                  });
        stream.last_model = std::move(model);
      }
    } else {
      stream.instances[p->instance_id][p->tp_rank] = p->id;
      instance_stream_[p->instance_id] = p->stream;
    }
    participants_[p->id] = Entry{p, clock_->Now() + lease_};
  }
  NotifyRemoved(removed);
  LOG(INFO) << "registered " << p->Describe() << " as " << p->id;
  for (Listener* l : listeners_) l->OnParticipantAdded(*p);
  return std::shared_ptr<const Participant>(p);
}

absl::StatusOr<std::vector<std::shared_ptr<const Participant>>>
Registry::ReplaceInstance(const std::string& instance_id,
                          std::vector<std::unique_ptr<Participant>> ranks) {
  std::vector<std::shared_ptr<Participant>> fresh;
  std::vector<std::vector<std::string>> needed;
  for (auto& r : ranks) {
    needed.push_back(r->NeededNames());
    fresh.emplace_back(std::move(r));
  }
  std::vector<std::pair<std::shared_ptr<Participant>, std::string>> removed;
  {
    absl::MutexLock lock(&mu_);
    auto owner = instance_stream_.find(instance_id);
    if (owner == instance_stream_.end()) {
      return absl::NotFoundError(
          absl::StrCat("instance ", instance_id, " is not registered"));
    }
    const std::string old_stream = owner->second;
    // Check every new rank before changing anything. Ranks of the new
    // stream's own instance (the same id on the same stream) are the old
    // ones, which agree on tp_size by construction.
    auto sit = streams_.find(fresh[0]->stream);
    const Stream* target = sit == streams_.end() ? nullptr : &sit->second;
    for (size_t i = 0; i < fresh.size(); ++i) {
      absl::Status st = CheckDestinationLocked(*fresh[i], target, needed[i]);
      if (!st.ok()) return st;
    }
    std::vector<std::string> old_ids;
    for (const auto& [tp, id] : streams_.at(old_stream).instances.at(instance_id)) {
      old_ids.push_back(id);
    }
    auto kept = instance_options_.find(instance_id);
    const std::optional<LoadOptions> options =
        kept == instance_options_.end() ? std::nullopt
                                        : std::optional<LoadOptions>(kept->second);
    for (const std::string& id : old_ids) {
      EraseWithAdaptersLocked(id, "swapped to a new registration", &removed);
    }
    if (options.has_value()) instance_options_[instance_id] = *options;
    for (const auto& p : fresh) {
      const uint64_t serial = next_serial_++;
      p->id = absl::StrCat("dst.", p->instance_id, ".", p->tp_rank, ".",
                           absl::Hex(serial, absl::kZeroPad4));
      p->token = RandomToken();
      p->registered_at = absl::Now();
      Stream& stream = streams_[p->stream];
      stream.epoch = NextEpochLocked();
      stream.instances[p->instance_id][p->tp_rank] = p->id;
      instance_stream_[p->instance_id] = p->stream;
      participants_[p->id] = Entry{p, clock_->Now() + lease_};
    }
  }
  NotifyRemoved(removed);
  std::vector<std::shared_ptr<const Participant>> out;
  for (const auto& p : fresh) {
    LOG(INFO) << "swapped " << p->Describe() << " to a new registration as "
              << p->id;
    for (Listener* l : listeners_) l->OnParticipantAdded(*p);
    out.push_back(p);
  }
  return out;
}

absl::StatusOr<std::shared_ptr<const Participant>> Registry::ReplaceMemory(
    const std::shared_ptr<const Participant>& old,
    std::unique_ptr<Participant> updated) {
  absl::MutexLock lock(&mu_);
  auto it = participants_.find(old->id);
  if (it == participants_.end() || it->second.participant.get() != old.get()) {
    return absl::NotFoundError(absl::StrCat(
        old->Describe(), " (participant ", old->id, ") left or changed its "
        "regions while they were mapped; nothing was changed"));
  }
  std::shared_ptr<Participant> p(std::move(updated));
  it->second.participant = p;
  auto sit = streams_.find(p->stream);
  if (sit != streams_.end()) sit->second.epoch = NextEpochLocked();
  return std::shared_ptr<const Participant>(p);
}

absl::StatusOr<Registry::Entry*> Registry::FindLocked(
    const v1::ParticipantHandle& handle) {
  if (handle.participant_id().empty()) {
    return absl::InvalidArgumentError("handle.participant_id is required");
  }
  // Before the id is looked up or quoted (docs/api.md, "Limits").
  if (absl::Status s = CheckHandleLimits(handle); !s.ok()) return s;
  auto it = participants_.find(handle.participant_id());
  if (it == participants_.end()) {
    return absl::NotFoundError(absl::StrCat(
        "participant ", handle.participant_id(),
        " is not registered (deregistered, or its lease ran out): register "
        "again"));
  }
  if (it->second.participant->token != handle.token()) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the token does not match participant ", handle.participant_id()));
  }
  return &it->second;
}

absl::StatusOr<std::shared_ptr<const Participant>> Registry::Authenticate(
    const v1::ParticipantHandle& handle) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Entry*> e = const_cast<Registry*>(this)->FindLocked(handle);
  if (!e.ok()) return e.status();
  return std::shared_ptr<const Participant>((*e)->participant);
}

absl::Status Registry::Remove(const v1::ParticipantHandle& handle) {
  std::vector<std::pair<std::shared_ptr<Participant>, std::string>> removed;
  {
    absl::MutexLock lock(&mu_);
    absl::StatusOr<Entry*> e = FindLocked(handle);
    if (!e.ok()) return e.status();
    EraseWithAdaptersLocked(handle.participant_id(), "deregistered",
                            &removed);
  }
  NotifyRemoved(removed);
  return absl::OkStatus();
}

int Registry::RemoveNode(const std::string& node, const std::string& why) {
  std::vector<std::pair<std::shared_ptr<Participant>, std::string>> removed;
  {
    absl::MutexLock lock(&mu_);
    std::vector<std::string> doomed;
    for (const auto& [id, entry] : participants_) {
      if (entry.participant->node == node) doomed.push_back(id);
    }
    for (const std::string& id : doomed) {
      EraseWithAdaptersLocked(id, why, &removed);
    }
  }
  NotifyRemoved(removed);
  return static_cast<int>(removed.size());
}
}  // namespace ferry
