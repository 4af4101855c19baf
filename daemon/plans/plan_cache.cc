#include "daemon/plans/plan_cache.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/parallel_for.h"
#include "core/planner.h"
#include "core/validation.h"
#include "daemon/registry/table_interner.h"
#include "glog/logging.h"

namespace ferry {
namespace {

// The stream's model: every declared parameter once, sorted by name.
// The sources' parameters; while they are not all registered (a trainer
// gone between runs, or restarting), those of the last complete set.
ModelSpec BuildModel(const Registry::StreamSnapshot& s) {
  if (s.sources_complete() && s.declared_model != nullptr) {
    // The registry's union of what the sources declare: merging every
    // rank's own list again (256 ranks x 140,000 names for Kimi-K2) was
    // most of a plan's cost.
    ModelSpec model;
    model.params = *s.declared_model;
    // The registry keeps it in name order; names are unique, so any sort
    // gives the same order, and one is needed only if that ever changes.
    auto by_name = [](const ParamSpec& a, const ParamSpec& b) {
      return a.name < b.name;
    };
    if (!std::is_sorted(model.params.begin(), model.params.end(), by_name)) {
      ParallelStableSort(model.params.begin(), model.params.end(),
                         PlanningThreads(), by_name);
    }
    model.BuildIndex();  // in name order: no index to build
    return model;
  }
  std::map<std::string, ParamSpec> by_name;
  const bool retained = !s.sources_complete() && s.retained_model != nullptr;
  if (retained) {
    for (const ParamSpec& p : *s.retained_model) by_name.emplace(p.name, p);
  }
  for (const auto& src : s.sources) {
    if (src == nullptr || retained) continue;
    for (const ParamSpec& p : *src->params) by_name.emplace(p.name, p);
  }
  ModelSpec model;
  for (auto& [name, p] : by_name) model.params.push_back(p);
  model.BuildIndex();
  return model;
}

// An explicit-pieces instance in the model's indices.
absl::StatusOr<std::vector<RankLayout>> ExplicitLayout(
    const ModelSpec& model, const PlannedInstance& inst) {
  std::vector<RankLayout> ranks;
  for (const auto& p : inst.ranks) {
    RankLayout r;
    r.rank = p->tp_rank;
    r.node = p->node;
    r.buffer_bytes = p->memory->sizes();
    r.buffer_ids = p->memory->ids();
    for (Piece piece : p->pieces) {
      const std::string& name = p->piece_params[piece.param];
      piece.param = model.Find(name);
      if (piece.param < 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            p->Describe(), ": piece of ", name, " box ",
            BoxToString(piece.box), ": the stream does not declare ", name));
      }
      // A box whose strides would overflow gets none: it lies outside every
      // shape that validated, as ValidateDestination then reports.
      if (piece.strides.empty() && ValidateShape(piece.box.extent).ok()) {
        piece.strides = RowMajorStrides(
            StorageShape(piece.box.extent, model.params[piece.param].dtype));
      }
      r.pieces.push_back(std::move(piece));
    }
    ranks.push_back(std::move(r));
  }
  return ranks;
}

// An engine-table instance: resolved into direct and staging pieces. The
// registry's tables are read in place (one list may serve every replica).
absl::StatusOr<ResolvedInstance> Resolve(const ModelSpec& model,
                                         const PlannedInstance& inst,
                                         LoadFormat format) {
  std::vector<EngineTableView> tables;
  tables.reserve(inst.ranks.size());
  for (const auto& p : inst.ranks) {
    tables.push_back(EngineTableView{p->tp_rank, p->tp_size, p->node,
                                     *p->engine_params, p->memory->sizes()});
  }
  return ResolveDestinationLayout(model, tables, format);
}

// Whether two instances registered the same engine tables (rank by rank:
// TP place, buffer sizes, every parameter), so that one resolution serves
// both: replicas of an engine do, whatever nodes they run on.
using Ranks = std::vector<std::shared_ptr<const Participant>>;
bool SameTables(const Ranks& a, const Ranks& b) {
  if (a.size() != b.size()) return false;
  for (size_t r = 0; r < a.size(); ++r) {
    const Participant& x = *a[r];
    const Participant& y = *b[r];
    if (x.tp_rank != y.tp_rank || x.tp_size != y.tp_size ||
        x.memory->sizes() != y.memory->sizes() ||
        (x.engine_params != y.engine_params &&
         *x.engine_params != *y.engine_params)) {
      return false;
    }
  }
  return true;
}

std::string ExplicitFallbackOnly(const std::string& id) {
  return absl::StrCat("instance ", id, ": load_format fallback_only needs an "
                      "engine table (a loader to fall back to); the instance "
                      "registers explicit pieces");
}

}  // namespace

absl::Status CheckLoadFormat(const StreamPlan& sp, int32_t instance,
                             LoadFormat format) {
  const PlannedInstance& inst = sp.instances[instance];
  if (inst.ranks.empty() || !inst.ranks[0]->engine_table) {
    if (format == LoadFormat::kFallbackOnly) {
      return absl::FailedPreconditionError(ExplicitFallbackOnly(inst.id));
    }
    return absl::OkStatus();
  }
  if (!sp.source_error.empty()) return absl::OkStatus();  // nothing to check
  absl::StatusOr<ResolvedInstance> r = Resolve(sp.model, inst, format);
  if (!r.ok()) {
    return absl::Status(r.status().code(), absl::StrCat("instance ", inst.id,
                                                        ": ", r.status().message()));
  }
  return absl::OkStatus();
}

bool RetiringAdapter(const PlannedInstance& instance) {
  for (const auto& r : instance.ranks) {
    if (r->adapter != nullptr && r->adapter->retiring.load()) return true;
  }
  return false;
}

int32_t StreamPlan::FindInstance(const std::string& id) const {
  for (size_t i = 0; i < instances.size(); ++i) {
    if (instances[i].id == id) return static_cast<int32_t>(i);
  }
  return -1;
}

int32_t StreamPlan::InstanceAtPlanIndex(int32_t plan_index) const {
  for (size_t i = 0; i < instances.size(); ++i) {
    if (instances[i].plan_index == plan_index) return static_cast<int32_t>(i);
  }
  return -1;
}

namespace {

// What the planner takes of a planned instance. A shared resolution
// carries the first replica's nodes in its layout: the planner takes each
// instance's own from here.
Instance PlannerInstance(const PlannedInstance& inst) {
  Instance out{inst.id, inst.layout, {}};
  for (const auto& r : inst.ranks) out.nodes.push_back(r->node);
  out.may_relay = inst.options.serve_as_peer;
  return out;
}

}  // namespace

const InstancePlan& StreamPlan::DirectPlan(int32_t plan_index) const {
  const InstancePlan& relayed = plan.instances[plan_index];
  if (relayed.relay_from < 0) return relayed;
  // Set whenever some instance relays (BuildStreamPlan).
  DirectSlot& slot = direct_slots[plan_index];
  absl::call_once(slot.once, [&] {
    slot.plan = source_planner->PlanFromSourcesOf(plan, planner_instances,
                                                  plan_index);
  });
  return slot.plan;
}

const Exchange* StreamPlan::ExchangeOf(int32_t plan_index) const {
  if (plan_index < 0 || static_cast<size_t>(plan_index) >= exchanges.size()) {
    return nullptr;
  }
  const Exchange& e = exchanges[plan_index];
  return e.partner >= 0 ? &e : nullptr;
}

bool StreamPlan::RelayRuns(int32_t instance, const std::string& node) const {
  const PlannedInstance& pi = instances[instance];
  // An instance with an exchange reads the sources and its partner: the
  // exchanges were chosen for instances whose relay does not run with the
  // coordinator on none of their nodes, and a coordinator on theirs keeps
  // to that (a relay on top could wait on a replica that waits on it).
  if (ExchangeOf(pi.plan_index) != nullptr) return false;
  switch (relay_where[pi.plan_index]) {
    case RelayWhere::kNever:
      return false;
    case RelayWhere::kAlways:
      return true;
    case RelayWhere::kCoordinatorsNode:  // both on pi's node
      return node.empty() || pi.ranks[0]->node == node;
  }
  return false;
}

std::shared_ptr<const StreamPlan> BuildStreamPlan(
    const Registry::StreamSnapshot& s, const StreamPlan* previous,
    const PlanCacheOptions& cache_options) {
  auto out = std::make_shared<StreamPlan>();
  out->stream = s.name;
  out->epoch = s.epoch;
  out->model = BuildModel(s);
  out->sources = s.sources;
  if (!s.sources_complete()) {
    std::vector<int32_t> missing;
    for (int32_t r = 0; r < s.world_size; ++r) {
      if (r >= static_cast<int32_t>(s.sources.size()) || !s.sources[r]) {
        missing.push_back(r);
      }
    }
    out->source_error =
        s.world_size == 0
            ? absl::StrCat("stream ", s.name, " has no source registered")
            : absl::StrCat("stream ", s.name, ": source ranks [",
                           absl::StrJoin(missing, ", "), "] of world_size ",
                           s.world_size, " are not registered");
  } else {
    // Ranks that declared an equal list share it (table_interner.h): its
    // indices are mapped to the model's once per list, not once per piece.
    std::map<const std::vector<ParamSpec>*, std::vector<int32_t>> model_index;
    for (const auto& src : s.sources) {
      std::vector<int32_t>& to_model = model_index[src->params.get()];
      if (to_model.empty()) {
        for (const ParamSpec& spec : *src->params) {
          to_model.push_back(out->model.Find(spec.name));
        }
      }
    }
    // Each rank's pieces in the model's indices, rank by rank on the
    // planning threads (1.3 million pieces for Kimi-K2's 256 ranks).
    out->source_layouts.resize(s.sources.size());
    ParallelFor(s.sources.size(), PlanningThreads(), [&](size_t k) {
      const auto& src = s.sources[k];
      const std::vector<int32_t>& to_model =
          model_index.find(src->params.get())->second;
      RankLayout& r = out->source_layouts[k];
      r.rank = src->rank;
      r.node = src->node;
      r.buffer_bytes = src->memory->sizes();
      r.buffer_ids = src->memory->ids();
      r.pieces.reserve(src->pieces.size());
      for (Piece piece : src->pieces) {
        piece.param = to_model[piece.param];
        r.pieces.push_back(std::move(piece));
      }
    });
  }

  // Resolutions made so far, shared by instances with the same tables and
  // load format (replicas): resolving and validating 2M pieces is most of
  // a plan's cost, and the planner then sees one layout, not one each.
  struct Resolved {
    Ranks ranks;  // whose tables were resolved
    LoadFormat format;
    std::shared_ptr<const ResolvedInstance> resolved;
    std::shared_ptr<const std::vector<RankLayout>> layout;
    std::string error;  // resolution or validation, without the instance id
  };
  std::vector<Resolved> resolutions;
  // And those of the plan before, when the model is the same: a replica
  // that joins or leaves, or a source that registers again, changes no
  // other instance's resolution.
  if (previous != nullptr && SameSpecs(previous->model.params,
                                       out->model.params)) {
    for (const PlannedInstance& inst : previous->instances) {
      if (inst.resolved == nullptr || !inst.error.empty()) continue;
      const bool held = std::any_of(
          resolutions.begin(), resolutions.end(),
          [&](const Resolved& r) { return r.resolved == inst.resolved; });
      if (held) continue;  // replicas shared it
      resolutions.push_back(Resolved{inst.ranks, inst.options.load_format,
                                     inst.resolved, inst.layout, ""});
    }
  }
  for (const Registry::InstanceMembers& m : s.instances) {
    if (!m.complete()) continue;
    PlannedInstance inst;
    inst.id = m.id;
    inst.ranks = m.ranks;
    inst.options = m.options;
    // Without every source, instances still resolve against the model
    // when it is known (peer deliveries need nothing else); no version can
    // begin (BeginVersion refuses with source_error).
    if (!out->source_error.empty() && out->model.params.empty()) {
      inst.error = out->source_error;
    } else if (inst.ranks[0]->engine_table) {
      const Resolved* known = nullptr;
      for (const Resolved& r : resolutions) {
        if (r.format == inst.options.load_format &&
            SameTables(r.ranks, inst.ranks)) {
          known = &r;
          break;
        }
      }
      if (known == nullptr) {
        Resolved fresh{inst.ranks, inst.options.load_format, nullptr, nullptr,
                       ""};
        absl::StatusOr<ResolvedInstance> resolved =
            Resolve(out->model, inst, inst.options.load_format);
        if (resolved.ok()) {
          // The pieces move to the layout the planner reads; the rest
          // (decisions, fallback tensors) stays in `resolved`.
          auto layout = std::make_shared<std::vector<RankLayout>>();
          layout->reserve(resolved->ranks.size());
          for (ResolvedRank& r : resolved->ranks) {
            layout->push_back(std::move(r.layout));
          }
          absl::Status v = ValidateDestination(out->model, *layout, m.id);
          if (!v.ok()) fresh.error = std::string(v.message());
          fresh.resolved =
              std::make_shared<const ResolvedInstance>(*std::move(resolved));
          fresh.layout = std::move(layout);
        } else {
          fresh.error = std::string(resolved.status().message());
        }
        resolutions.push_back(std::move(fresh));
        known = &resolutions.back();
      }
      if (known->error.empty()) {
        inst.resolved = known->resolved;
        inst.layout = known->layout;
      } else {
        inst.error = absl::StrCat("instance ", m.id, ": ", known->error);
      }
    } else if (inst.options.load_format == LoadFormat::kFallbackOnly) {
      inst.error = ExplicitFallbackOnly(m.id);
    } else {
      absl::StatusOr<std::vector<RankLayout>> layout =
          ExplicitLayout(out->model, inst);
      if (layout.ok()) {
        inst.layout = std::make_shared<const std::vector<RankLayout>>(
            *std::move(layout));
      } else {
        inst.error = std::string(layout.status().message());
      }
    }
    if (inst.error.empty() && !inst.ranks[0]->engine_table) {
      // Engine-table layouts were validated once per resolution, above.
      absl::Status v = ValidateDestination(out->model, *inst.layout, m.id);
      if (!v.ok()) inst.error = absl::StrCat("instance ", m.id, ": ", v.message());
    }
    out->instances.push_back(std::move(inst));
  }
  if (!out->source_error.empty()) return out;

  std::vector<Instance> planned;
  for (PlannedInstance& inst : out->instances) {
    if (!inst.error.empty()) continue;
    inst.plan_index = static_cast<int32_t>(planned.size());
    planned.push_back(PlannerInstance(inst));
  }
  PlanOptions options;
  options.bucket_bytes = cache_options.bucket_bytes;
  options.destinations_validated = true;  // every planned layout, above
  absl::StatusOr<std::unique_ptr<const SourcePlanner>> planner =
      SourcePlanner::Create(out->model, out->source_layouts, options);
  absl::StatusOr<Plan> plan = planner.ok()
                                  ? (*planner)->PlanInstances(planned)
                                  : absl::StatusOr<Plan>(planner.status());
  if (!plan.ok()) {
    // Instances were validated one by one above, so this is the sources.
    out->source_error =
        absl::StrCat("stream ", s.name, ": ", plan.status().message());
    for (PlannedInstance& inst : out->instances) {
      if (inst.error.empty()) inst.error = out->source_error;
      inst.plan_index = -1;
    }
    return out;
  }
  out->plan = *std::move(plan);
  const SourcePlanner& source_planner = **planner;
  // Relayed replicas read the sources only when their relay fails: keep
  // what plans them then (the sources' index), not their copies.
  if (std::any_of(out->plan.instances.begin(), out->plan.instances.end(),
                  [](const InstancePlan& ip) { return ip.relay_from >= 0; })) {
    out->source_planner = *std::move(planner);
    out->direct_slots.reset(
        new StreamPlan::DirectSlot[out->plan.instances.size()]);
  }
  const std::vector<RelayTree> trees = RelayTrees(out->plan);
  const int source_nodes = SourceNodes(out->source_layouts);
  for (size_t k = 0; k < planned.size(); ++k) {
    out->relay_where.push_back(WhereRelayRuns(
        out->plan, planned, static_cast<int32_t>(k), trees, source_nodes));
  }
  out->planner_instances = std::move(planned);
  if (cache_options.exchange) {
    std::vector<Exchange> exchanges = ChooseExchanges(
        source_planner, out->source_layouts, out->planner_instances,
        out->plan, [&](int32_t k) -> const InstancePlan& {
          return out->DirectPlan(k);
        });
    if (std::any_of(exchanges.begin(), exchanges.end(),
                    [](const Exchange& e) { return e.partner >= 0; })) {
      out->exchanges = std::move(exchanges);
    }
    for (size_t k = 0; k < out->exchanges.size(); ++k) {
      const Exchange& e = out->exchanges[k];
      if (e.partner < 0) continue;
      LOG(INFO) << "stream " << s.name << ": instance "
                << out->plan.instances[k].instance << " is given "
                << e.buckets.size() << " buckets (" << e.bytes
                << " bytes) by " << out->plan.instances[e.partner].instance;
    }
  }
  LOG(INFO) << "planned stream " << s.name << " (epoch " << s.epoch << "): "
            << out->plan.instances.size() << " instances, digest " << std::hex
            << out->plan.digest;
  return out;
}

absl::StatusOr<std::shared_ptr<const StreamPlan>> PlanCache::Get(
    const std::string& stream) {
  absl::StatusOr<Registry::StreamSnapshot> snapshot =
      registry_->Snapshot(stream);
  if (!snapshot.ok()) {
    // The stream is gone (its last participant left): so is its plan, and
    // with it the participants' memory it kept mapped.
    absl::MutexLock lock(&mu_);
    cache_.erase(stream);
    return snapshot.status();
  }
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(stream);
    if (it != cache_.end() && it->second->epoch == snapshot->epoch) {
      if (metrics_ != nullptr) metrics_->PlanLookup(/*hit=*/true);
      return it->second;
    }
  }
  if (metrics_ != nullptr) metrics_->PlanLookup(/*hit=*/false);
  std::shared_ptr<const StreamPlan> previous;
  {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(stream);
    if (it != cache_.end()) previous = it->second;
  }
  std::shared_ptr<const StreamPlan> plan =
      BuildStreamPlan(*snapshot, previous.get(), options_);
  absl::MutexLock lock(&mu_);
  auto& slot = cache_[stream];
  if (slot == nullptr || slot->epoch <= plan->epoch) slot = plan;
  return plan;
}

}  // namespace ferry
