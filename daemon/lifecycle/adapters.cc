#include "daemon/lifecycle/adapters.h"

#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/lifecycle/adapter_ranks.h"
#include "glog/logging.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "proto/convert.h"

namespace ferry {

namespace {


std::string AdapterInstanceId(const std::string& instance,
                              const std::string& name, uint64_t n) {
  return absl::StrCat(instance, ":", name, ":", n);
}

// The adapter stream's tensors: what its complete sources declare, or
// what the last complete set of them declared; sorted by name.
absl::StatusOr<std::vector<ParamSpec>> AdapterTensors(
    const Registry& registry, const std::string& name,
    const std::string& stream) {
  absl::StatusOr<Registry::StreamSnapshot> snap = registry.Snapshot(stream);
  if (!snap.ok()) {
    return absl::NotFoundError(absl::StrCat(
        "adapter ", name, ": adapter stream ", stream, " is not registered "
        "(the trainer's adapter ranks register its tensors as sources)"));
  }
  std::map<std::string, ParamSpec> tensors;
  if (snap->sources_complete()) {
    for (const auto& s : snap->sources) {
      for (const ParamSpec& p : *s->params) tensors.emplace(p.name, p);
    }
  } else if (snap->retained_model != nullptr) {
    for (const ParamSpec& p : *snap->retained_model) tensors.emplace(p.name, p);
  } else {
    return absl::FailedPreconditionError(absl::StrCat(
        "adapter ", name, ": adapter stream ", stream, " has ",
        snap->sources.size(), " of its ", snap->world_size,
        " source ranks registered; its tensors are known once all are"));
  }
  std::vector<ParamSpec> out;
  for (auto& [n, p] : tensors) out.push_back(std::move(p));
  return out;
}

}  // namespace

absl::StatusOr<AdapterConfig> ParseAdapterConfig(const std::string& json) {
  google::protobuf::Struct parsed;
  const auto status = google::protobuf::util::JsonStringToMessage(json, &parsed);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "adapter_config_json is not a JSON object: ",
        std::string(status.message())));
  }
  AdapterConfig config;
  const auto& fields = parsed.fields();
  auto r = fields.find("r");
  if (r != fields.end()) {
    const double v = r->second.number_value();
    if (r->second.kind_case() != google::protobuf::Value::kNumberValue ||
        v < 1 || v > (int64_t{1} << 31) || v != static_cast<int64_t>(v)) {
      return absl::InvalidArgumentError(
          "adapter_config_json: \"r\" must be a positive integer");
    }
    config.rank = static_cast<int64_t>(v);
  }
  auto t = fields.find("target_modules");
  if (t != fields.end() &&
      t->second.kind_case() == google::protobuf::Value::kListValue) {
    for (const auto& m : t->second.list_value().values()) {
      if (m.kind_case() != google::protobuf::Value::kStringValue) {
        return absl::InvalidArgumentError(
            "adapter_config_json: \"target_modules\" must list strings");
      }
      config.target_modules.push_back(m.string_value());
    }
  }
  return config;
}

namespace {

// Adds `p`'s adapter rank to its adapter's entry (by base instance, name).
using AdapterIndex = std::map<std::string, std::map<std::string, v1::AdapterInfo>>;
void AddRank(const Participant& p, const VersionCoordinator& coordinator,
             AdapterIndex& index) {
  v1::AdapterInfo& info = index[p.adapter->base_instance][p.adapter->name];
  if (info.name().empty()) {
    info.set_name(p.adapter->name);
    info.set_stream(p.stream);
    info.set_stream_instance_id(p.instance_id);
    *info.mutable_status() =
        coordinator.InstanceStatusOf(p.instance_id, p.held_version);
  }
  info.set_bytes(info.bytes() + p.adapter->bytes);
}

std::vector<v1::AdapterInfo> Flatten(
    std::map<std::string, v1::AdapterInfo>& by_name) {
  std::vector<v1::AdapterInfo> out;
  for (auto& [name, info] : by_name) out.push_back(std::move(info));
  return out;
}

}  // namespace

std::map<std::string, std::vector<v1::AdapterInfo>> AdaptersByInstance(
    const Registry& registry, const VersionCoordinator& coordinator) {
  AdapterIndex index;
  for (const auto& p : registry.List()) {
    if (p->adapter != nullptr && !p->adapter->retiring.load()) {
      AddRank(*p, coordinator, index);
    }
  }
  std::map<std::string, std::vector<v1::AdapterInfo>> out;
  for (auto& [instance, by_name] : index) out[instance] = Flatten(by_name);
  return out;
}

std::vector<v1::AdapterInfo> AdaptersOf(const Registry& registry,
                                        const VersionCoordinator& coordinator,
                                        const std::string& instance_id) {
  AdapterIndex index;
  for (const auto& p : registry.List()) {
    if (p->adapter != nullptr && p->adapter->base_instance == instance_id &&
        !p->adapter->retiring.load()) {
      AddRank(*p, coordinator, index);
    }
  }
  return Flatten(index[instance_id]);
}

std::shared_ptr<const Participant> Adapters::FindLocked(
    const std::string& instance_id, const std::string& name) const {
  for (const auto& p : registry_->List()) {
    if (p->adapter != nullptr && p->adapter->base_instance == instance_id &&
        p->adapter->name == name && !p->adapter->retiring.load()) {
      return p;
    }
  }
  return nullptr;
}

namespace {

// BuildRanksLocked, step 1: the base instance in its stream's plan,
// complete and planned.
absl::StatusOr<const PlannedInstance*> PlannedBase(
    const StreamPlan& sp, const std::string& base_stream,
    const std::string& instance_id, const std::string& who) {
  const int32_t at = sp.FindInstance(instance_id);
  if (at < 0) {
    return absl::NotFoundError(absl::StrCat(
        who, ": stream ", base_stream, " has no complete instance ",
        instance_id, " (every tp rank registered)"));
  }
  const PlannedInstance& base = sp.instances[at];
  if (!base.error.empty() || base.layout == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        who, ": the instance's own layout does not plan: ", base.error));
  }
  return &base;
}

}  // namespace

absl::StatusOr<std::vector<std::unique_ptr<Participant>>>
Adapters::BuildRanksLocked(const std::string& base_stream,
                           const std::string& instance_id,
                           const std::string& name,
                           const std::string& adapter_stream,
                           const std::string& config_json) {
  const std::string who =
      absl::StrCat("adapter ", name, " on instance ", instance_id);
  // 1: the request, the adapter's tensors and the base instance's plan.
  if (adapter_stream == base_stream) {
    return absl::InvalidArgumentError(absl::StrCat(
        who, ": adapter_stream ", adapter_stream, " is the instance's own "
        "stream; an adapter's tensors come on a stream of their own"));
  }
  absl::StatusOr<AdapterConfig> config = ParseAdapterConfig(config_json);
  if (!config.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": ", config.status().message()));
  }
  // The adapter's tensors before the instance's plan: a lookup, where
  // planning a large model takes a while.
  absl::StatusOr<std::vector<ParamSpec>> tensors =
      AdapterTensors(*registry_, name, adapter_stream);
  if (!tensors.ok()) return tensors.status();
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan =
      plans_->Get(base_stream);
  if (!plan.ok()) return plan.status();
  const StreamPlan& sp = **plan;
  absl::StatusOr<const PlannedInstance*> planned =
      PlannedBase(sp, base_stream, instance_id, who);
  if (!planned.ok()) return planned.status();
  const PlannedInstance& base = **planned;
  auto on_member = [&](const Participant& r) {
    return !options_.node.empty() && r.node != options_.node;
  };
  for (const auto& r : base.ranks) {
    if (on_member(*r) && !options_.remote_memory) {
      return absl::UnimplementedError(absl::StrCat(
          who, ": tp rank ", r->tp_rank, " is on node ", r->node,
          ", a member's, and this daemon has no path to members' memory"));
    }
  }
  // 2: where each rank's shares of the adapter lie.
  absl::StatusOr<AdapterSharePlan> shares =
      PlanAdapterShares(name, *tensors, sp.model, *base.layout, *config);
  if (!shares.ok()) return shares.status();

  // 3: each rank laid out, staged and mapped.
  const std::string id =
      AdapterInstanceId(instance_id, name, next_attachment_++);
  std::vector<std::unique_ptr<Participant>> ranks;
  // Staging already made on members, dropped again if a later rank fails.
  struct Undo {
    Adapters* self;
    std::vector<std::pair<std::string, std::string>> staged;  // node, id
    ~Undo() { self->DropOnMembers(staged); }
  } undo{this, {}};
  for (size_t k = 0; k < base.ranks.size(); ++k) {
    const Participant& engine = *base.ranks[k];
    const bool remote = on_member(engine);
    auto binding = std::make_shared<AdapterBinding>();
    binding->base_id = engine.id;
    binding->base_instance = instance_id;
    binding->name = name;
    binding->config_json = config_json;
    auto p = std::make_unique<Participant>();
    LayOutAdapterShares(shares->ranks[k], *tensors, binding.get(), p.get());
    // Its id is chosen here: a member holds the staging under it.
    p->id = absl::StrCat("adp.", id, ".", k);
    if (absl::Status s = MakeAdapterStaging(
            options_.remote_memory, remote, engine, p->id,
            absl::StrCat(instance_id, ".", k, ".", name),
            absl::StrCat(who, ": tp rank ", k), binding.get());
        !s.ok()) {
      return s;
    }
    p->node = engine.node;
    if (remote) undo.staged.emplace_back(engine.node, p->id);
    MapOptions map_options;  // the daemon's own memory: no caller to check
    // A member's staging is mapped there, not here.
    if (remote) map_options.map_memory = false;
    if (absl::Status s = MapAdapterRank(engine, adapter_stream, id, who,
                                        map_options, std::move(binding),
                                        p.get());
        !s.ok()) {
      return s;
    }
    ranks.push_back(std::move(p));
  }
  undo.staged.clear();  // they are the caller's now
  return ranks;
}

void Adapters::DropOnMembers(
    const std::vector<std::pair<std::string, std::string>>& ranks) {
  for (const auto& [node, id] : ranks) {
    if (options_.node.empty() || node == options_.node ||
        !options_.remote_memory) {
      continue;
    }
    v1::ManageMemoryRequest drop;
    drop.set_action(v1::MEMORY_ACTION_DROP_ADAPTER);
    drop.add_participant_ids(id);
    absl::StatusOr<v1::ManageMemoryResponse> done =
        options_.remote_memory(node, drop);
    if (!done.ok()) {
      LOG(WARNING) << "adapter rank " << id << ": its staging on node "
                   << node << " was not released: " << done.status();
    }
  }
}

std::vector<std::pair<std::string, std::string>> Adapters::RanksOf(
    const std::string& adapter_instance) const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& p : registry_->List()) {
    if (p->adapter != nullptr && p->instance_id == adapter_instance) {
      out.emplace_back(p->node, p->id);
    }
  }
  return out;
}

absl::StatusOr<v1::InstanceStatus> Adapters::AttachLocked(
    std::vector<std::unique_ptr<Participant>> ranks,
    const VersionCoordinator::Expired& expired) {
  const std::string stream = ranks[0]->stream;
  const std::string id = ranks[0]->instance_id;
  // To release their members' staging if the registry refuses them.
  std::vector<std::pair<std::string, std::string>> staged;
  for (const auto& p : ranks) staged.emplace_back(p->node, p->id);
  absl::StatusOr<std::vector<std::shared_ptr<const Participant>>> attached =
      registry_->AttachAdapter(std::move(ranks));
  if (!attached.ok()) {
    DropOnMembers(staged);
    return attached.status();
  }
  return coordinator_->adapters().WaitForFill(stream, id, options_.fill_wait,
                                              expired);
}

absl::StatusOr<v1::InstanceStatus> Adapters::Load(
    const std::string& base_stream, const v1::LoadAdapterRequest& request,
    const VersionCoordinator::Expired& expired) {
  absl::MutexLock lock(&mu_);
  const std::string& instance = request.instance_id();
  const std::string& name = request.adapter_name();
  if (std::shared_ptr<const Participant> loaded = FindLocked(instance, name)) {
    return absl::AlreadyExistsError(absl::StrCat(
        "adapter ", name, " is already loaded on instance ", instance,
        " (from stream ", loaded->stream, "); UpdateAdapter repoints it, "
        "UnloadAdapter removes it"));
  }
  if (coordinator_->offloads().IsOffloaded(instance)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "LoadAdapter(", instance, ", ", name, "): the instance is offloaded "
        "(Lifecycle.Onload it first)"));
  }
  absl::StatusOr<std::vector<std::unique_ptr<Participant>>> ranks =
      BuildRanksLocked(base_stream, instance, name, request.adapter_stream(),
                       request.adapter_config_json());
  if (!ranks.ok()) return ranks.status();
  LOG(INFO) << "adapter " << name << " loading on instance " << instance
            << " from stream " << request.adapter_stream() << " as "
            << (*ranks)[0]->instance_id;
  return AttachLocked(*std::move(ranks), expired);
}

absl::StatusOr<v1::InstanceStatus> Adapters::Update(
    const std::string& base_stream, const v1::UpdateAdapterRequest& request,
    const VersionCoordinator::Expired& expired) {
  absl::MutexLock lock(&mu_);
  const std::string& instance = request.instance_id();
  const std::string& name = request.adapter_name();
  std::shared_ptr<const Participant> old = FindLocked(instance, name);
  if (old == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "adapter ", name, " is not loaded on instance ", instance));
  }
  if (request.adapter_stream().empty() &&
      request.adapter_config_json().empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "UpdateAdapter(", instance, ", ", name, "): set adapter_stream, "
        "adapter_config_json or both"));
  }
  const std::string stream = request.adapter_stream().empty()
                                 ? old->stream
                                 : request.adapter_stream();
  const std::string config = request.adapter_config_json().empty()
                                 ? old->adapter->config_json
                                 : request.adapter_config_json();
  absl::StatusOr<std::vector<std::unique_ptr<Participant>>> ranks =
      BuildRanksLocked(base_stream, instance, name, stream, config);
  if (!ranks.ok()) return ranks.status();
  const std::string old_id = old->instance_id;
  LOG(INFO) << "adapter " << name << " on instance " << instance
            << " moving from " << old_id << " (stream " << old->stream
            << ") to " << (*ranks)[0]->instance_id << " (stream " << stream
            << ")";
  // From here on the old attachment takes no new version: the engine sees
  // one sequence of events for the name. It may still be the peer the new
  // one is filled from.
  old->adapter->retiring.store(true);
  absl::StatusOr<v1::InstanceStatus> status =
      AttachLocked(*std::move(ranks), expired);
  if (!status.ok()) {
    old->adapter->retiring.store(false);  // nothing changed
    return status;
  }
  const auto old_ranks = RanksOf(old_id);
  registry_->DetachAdapter(old_id, "replaced by UpdateAdapter");
  coordinator_->ForgetInstance(old_id);
  DropOnMembers(old_ranks);
  return status;
}

absl::Status Adapters::Unload(const v1::UnloadAdapterRequest& request,
                              const VersionCoordinator::Expired& expired) {
  absl::MutexLock lock(&mu_);
  const std::string& instance = request.instance_id();
  const std::string& name = request.adapter_name();
  std::shared_ptr<const Participant> loaded = FindLocked(instance, name);
  if (loaded == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "adapter ", name, " is not loaded on instance ", instance));
  }
  const std::string id = loaded->instance_id;
  loaded->adapter->retiring.store(true);
  absl::Status s =
      coordinator_->adapters().UnloadAdapter(loaded->stream, id, expired);
  // Detached either way: the engine was told, or it is late or failed, and
  // the adapter's staging is not kept for a rank that does not answer.
  const auto ranks = RanksOf(id);
  registry_->DetachAdapter(id, "unloaded");
  coordinator_->ForgetInstance(id);
  DropOnMembers(ranks);
  if (!s.ok()) {
    return absl::Status(s.code(), absl::StrCat(
        "UnloadAdapter(", instance, ", ", name, "): the adapter is detached "
        "and its staging released, but not every rank confirmed: ",
        s.message()));
  }
  LOG(INFO) << "adapter " << name << " unloaded from instance " << instance;
  return absl::OkStatus();
}

}  // namespace ferry
