// The Registry's read-only views (registry_views.h): a stream's snapshot
// (what the PlanCache plans from), stream names, a stream's model summary,
// the participant list, an instance's stream and load options. Part of the
// Registry class (registry.h: each view is consistent, taken under its one
// lock, mu_).
#include "daemon/registry/registry.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace ferry {

bool InstanceMembers::complete() const {
  if (tp_size <= 0 || static_cast<int32_t>(ranks.size()) != tp_size) {
    return false;
  }
  for (const auto& r : ranks) {
    if (r == nullptr) return false;
  }
  return true;
}

bool StreamSnapshot::sources_complete() const {
  if (world_size <= 0 || static_cast<int32_t>(sources.size()) != world_size) {
    return false;
  }
  for (const auto& s : sources) {
    if (s == nullptr) return false;
  }
  return true;
}

absl::StatusOr<const Registry::Stream*> Registry::FindStreamLocked(
    const std::string& stream) const {
  auto it = streams_.find(stream);
  if (it == streams_.end()) {
    return absl::NotFoundError(absl::StrCat("stream ", stream,
                                            " is unknown to this daemon"));
  }
  return &it->second;
}

absl::StatusOr<Registry::StreamSnapshot> Registry::Snapshot(
    const std::string& stream) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Stream*> found = FindStreamLocked(stream);
  if (!found.ok()) return found.status();
  const Stream& s = **found;
  StreamSnapshot out;
  out.name = stream;
  out.epoch = s.epoch;
  out.world_size = s.world_size;
  out.sources.resize(s.world_size);
  for (const auto& [rank, id] : s.sources) {
    if (rank < s.world_size) out.sources[rank] = participants_.at(id).participant;
  }
  for (const auto& [instance, ranks] : s.instances) {
    InstanceMembers m;
    m.id = instance;
    auto options = instance_options_.find(instance);
    if (options != instance_options_.end()) m.options = options->second;
    const Participant& first = *participants_.at(ranks.begin()->second).participant;
    m.tp_size = first.tp_size;
    m.held_version = first.held_version;
    m.ranks.resize(m.tp_size);
    for (const auto& [tp, id] : ranks) {
      const std::shared_ptr<Participant>& rank = participants_.at(id).participant;
      if (tp < m.tp_size) m.ranks[tp] = rank;
      m.held_version = std::min(m.held_version, rank->held_version);
    }
    out.instances.push_back(std::move(m));
  }
  if (!out.sources_complete()) {
    out.retained_model = s.last_model;
  } else {
    out.declared_model = s.last_model;
  }
  return out;
}

absl::StatusOr<uint64_t> Registry::EpochOf(const std::string& stream) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Stream*> found = FindStreamLocked(stream);
  if (!found.ok()) return found.status();
  return (*found)->epoch;
}

std::vector<std::string> Registry::StreamNames() const {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  for (const auto& [name, s] : streams_) names.push_back(name);
  return names;
}

absl::StatusOr<Registry::ModelSummary> Registry::ModelOf(
    const std::string& stream) const {
  absl::MutexLock lock(&mu_);
  absl::StatusOr<const Stream*> found = FindStreamLocked(stream);
  if (!found.ok()) return found.status();
  ModelSummary out;
  out.parameters = static_cast<int64_t>((*found)->declared.size());
  out.bytes = (*found)->model_bytes;
  return out;
}

std::vector<std::shared_ptr<const Participant>> Registry::List() const {
  std::vector<std::shared_ptr<const Participant>> out;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [id, e] : participants_) out.push_back(e.participant);
  }
  std::sort(out.begin(), out.end(),
            [](const std::shared_ptr<const Participant>& a,
               const std::shared_ptr<const Participant>& b) {
              auto key = [](const Participant& p) {
                return std::make_tuple(p.stream, p.role, p.rank, p.instance_id,
                                       p.tp_rank);
              };
              return key(*a) < key(*b);
            });
  return out;
}

absl::StatusOr<std::string> Registry::StreamOfInstance(
    const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  auto it = instance_stream_.find(instance_id);
  if (it == instance_stream_.end()) {
    return absl::NotFoundError(
        absl::StrCat("instance ", instance_id, " is not registered"));
  }
  return it->second;
}

absl::StatusOr<LoadOptions> Registry::InstanceOptions(
    const std::string& instance_id) const {
  absl::MutexLock lock(&mu_);
  if (!instance_stream_.count(instance_id)) {
    return absl::NotFoundError(
        absl::StrCat("instance ", instance_id, " is not registered"));
  }
  auto it = instance_options_.find(instance_id);
  return it == instance_options_.end() ? LoadOptions() : it->second;
}

absl::Status Registry::SetInstanceOptions(const std::string& instance_id,
                                          const LoadOptions& options) {
  absl::MutexLock lock(&mu_);
  auto it = instance_stream_.find(instance_id);
  if (it == instance_stream_.end()) {
    return absl::NotFoundError(
        absl::StrCat("instance ", instance_id, " is not registered"));
  }
  instance_options_[instance_id] = options;
  streams_[it->second].epoch = NextEpochLocked();
  return absl::OkStatus();
}

size_t Registry::participant_count() const {
  absl::MutexLock lock(&mu_);
  return participants_.size();
}
}  // namespace ferry
