// The Registry's adapter ranks (Lifecycle.LoadAdapter, adapters.h):
// attached in one step, all or nothing, and removed with their base rank
// or detached by instance. Part of the Registry class (registry.h: one
// lock, mu_).
#include "daemon/registry/registry.h"

#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ferry {

void Registry::EraseWithAdaptersLocked(const std::string& id,
                                       const std::string& why,
                                       Removed* removed) {
  if (!participants_.contains(id)) return;  // went with its base rank
  removed->emplace_back(EraseLocked(id), why);
  auto it = adapters_.find(id);
  if (it == adapters_.end()) return;
  const std::set<std::string> derived = std::move(it->second);
  adapters_.erase(it);
  for (const std::string& a : derived) {
    if (!participants_.contains(a)) continue;
    removed->emplace_back(EraseLocked(a),
                          absl::StrCat("its engine rank left: ", why));
  }
}

absl::StatusOr<std::vector<std::shared_ptr<const Participant>>>
Registry::AttachAdapter(std::vector<std::unique_ptr<Participant>> ranks) {
  std::vector<std::shared_ptr<Participant>> fresh;
  std::vector<std::vector<std::string>> needed;
  for (auto& r : ranks) {
    needed.push_back(r->NeededNames());
    fresh.emplace_back(std::move(r));
  }
  {
    absl::MutexLock lock(&mu_);
    const std::string& instance_id = fresh[0]->instance_id;
    if (instance_stream_.count(instance_id) > 0) {
      return absl::AlreadyExistsError(absl::StrCat(
          "instance ", instance_id, " is already registered"));
    }
    if (static_cast<int64_t>(participants_.size() + fresh.size()) >
        max_participants_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          fresh[0]->Describe(), ": this daemon holds ", participants_.size(),
          " participants; the adapter's ", fresh.size(), " ranks would pass "
          "the most it takes (docs/api.md, \"Limits\")"));
    }
    auto sit = streams_.find(fresh[0]->stream);
    const Stream* target = sit == streams_.end() ? nullptr : &sit->second;
    for (size_t i = 0; i < fresh.size(); ++i) {
      if (!participants_.contains(fresh[i]->adapter->base_id)) {
        return absl::NotFoundError(absl::StrCat(
            "instance ", fresh[i]->adapter->base_instance, " tp rank ",
            fresh[i]->tp_rank, " left while its adapter was being loaded"));
      }
      absl::Status st = CheckDestinationLocked(*fresh[i], target, needed[i]);
      if (!st.ok()) return st;
    }
    for (const auto& p : fresh) {
      if (!p->id.empty() && participants_.count(p->id) > 0) {
        return absl::AlreadyExistsError(
            absl::StrCat("participant ", p->id, " is already registered"));
      }
    }
    for (const auto& p : fresh) {
      const uint64_t serial = next_serial_++;
      // Ids the caller chose (a member holds the rank's staging under it).
      if (p->id.empty()) {
        p->id = absl::StrCat("adp.", p->instance_id, ".", p->tp_rank, ".",
                             absl::Hex(serial, absl::kZeroPad4));
      }
      p->token = RandomToken();  // never handed out: nobody calls as it
      p->registered_at = absl::Now();
      Stream& stream = streams_[p->stream];
      stream.epoch = NextEpochLocked();
      stream.instances[p->instance_id][p->tp_rank] = p->id;
      instance_stream_[p->instance_id] = p->stream;
      // It lives as long as its base rank, whose lease and process it
      // follows (EraseWithAdaptersLocked).
      participants_[p->id] = Entry{p, absl::InfiniteFuture()};
      adapters_[p->adapter->base_id].insert(p->id);
    }
  }
  std::vector<std::shared_ptr<const Participant>> out;
  for (const auto& p : fresh) {
    LOG(INFO) << "attached " << p->Describe() << " on stream " << p->stream
              << " as " << p->id;
    for (Listener* l : listeners_) l->OnParticipantAdded(*p);
    out.push_back(p);
  }
  return out;
}

int Registry::DetachAdapter(const std::string& instance_id,
                            const std::string& why) {
  Removed removed;
  {
    absl::MutexLock lock(&mu_);
    auto owner = instance_stream_.find(instance_id);
    if (owner == instance_stream_.end()) return 0;
    std::vector<std::string> ids;
    for (const auto& [tp, id] :
         streams_.at(owner->second).instances.at(instance_id)) {
      ids.push_back(id);
    }
    for (const std::string& id : ids) {
      const Participant& p = *participants_.at(id).participant;
      if (p.adapter == nullptr) continue;
      auto a = adapters_.find(p.adapter->base_id);
      if (a != adapters_.end()) {
        a->second.erase(id);
        if (a->second.empty()) adapters_.erase(a);
      }
      removed.emplace_back(EraseLocked(id), why);
    }
  }
  NotifyRemoved(removed);
  return static_cast<int>(removed.size());
}
}  // namespace ferry
