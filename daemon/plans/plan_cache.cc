#include "daemon/plans/plan_cache.h"

#include <algorithm>
#include <set>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "core/planner.h"
#include "core/validation.h"
#include "daemon/plans/quantizer_ranks.h"
#include "daemon/plans/stream_model.h"
#include "daemon/registry/table_interner.h"
#include "glog/logging.h"

namespace ferry {
namespace {

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

namespace {

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

// Step 2: the resolutions of the plan before, when the model is the same:
// a replica that joins or leaves, or a source that registers again,
// changes no other instance's resolution.
std::vector<Resolved> PreviousResolutions(const StreamPlan* previous,
                                          const ModelSpec& model) {
  std::vector<Resolved> resolutions;
  if (previous == nullptr || !SameSpecs(previous->model.params, model.params)) {
    return resolutions;
  }
  for (const PlannedInstance& inst : previous->instances) {
    if (inst.resolved == nullptr || !inst.error.empty()) continue;
    const bool held = std::any_of(
        resolutions.begin(), resolutions.end(),
        [&](const Resolved& r) { return r.resolved == inst.resolved; });
    if (held) continue;  // replicas shared it
    resolutions.push_back(Resolved{inst.ranks, inst.options.load_format,
                                   inst.resolved, inst.layout, ""});
  }
  return resolutions;
}

// Step 3a: resolves and validates an engine-table instance no earlier
// resolution serves.
Resolved ResolveFresh(const ModelSpec& model, const PlannedInstance& inst,
                      const std::string& id) {
  Resolved fresh{inst.ranks, inst.options.load_format, nullptr, nullptr, ""};
  absl::StatusOr<ResolvedInstance> resolved =
      Resolve(model, inst, inst.options.load_format);
  if (!resolved.ok()) {
    fresh.error = std::string(resolved.status().message());
    return fresh;
  }
  // The pieces move to the layout the planner reads; the rest
  // (decisions, fallback tensors) stays in `resolved`.
  auto layout = std::make_shared<std::vector<RankLayout>>();
  layout->reserve(resolved->ranks.size());
  for (ResolvedRank& r : resolved->ranks) {
    layout->push_back(std::move(r.layout));
  }
  absl::Status v = ValidateDestination(model, *layout, id);
  if (!v.ok()) fresh.error = std::string(v.message());
  fresh.resolved =
      std::make_shared<const ResolvedInstance>(*std::move(resolved));
  fresh.layout = std::move(layout);
  return fresh;
}

// Step 3b: an engine-table instance's layout, from a resolution that
// serves it (adding one to `resolutions` when none does), or its error.
void LayOutEngineTables(const ModelSpec& model, const std::string& id,
                        std::vector<Resolved>* resolutions,
                        PlannedInstance* inst) {
  const Resolved* known = nullptr;
  for (const Resolved& r : *resolutions) {
    if (r.format == inst->options.load_format &&
        SameTables(r.ranks, inst->ranks)) {
      known = &r;
      break;
    }
  }
  if (known == nullptr) {
    resolutions->push_back(ResolveFresh(model, *inst, id));
    known = &resolutions->back();
  }
  if (known->error.empty()) {
    inst->resolved = known->resolved;
    inst->layout = known->layout;
  } else {
    inst->error = absl::StrCat("instance ", id, ": ", known->error);
  }
}

// Step 3: one complete instance, laid out in the model's indices (engine
// tables resolved, explicit pieces mapped and validated), or its error.
PlannedInstance LayOutInstance(const StreamPlan& out,
                               const Registry::InstanceMembers& m,
                               std::vector<Resolved>* resolutions) {
  PlannedInstance inst;
  inst.id = m.id;
  inst.ranks = m.ranks;
  inst.options = m.options;
  // Without every source, instances still resolve against the model
  // when it is known (peer deliveries need nothing else); no version can
  // begin (BeginVersion refuses with source_error).
  if (!out.source_error.empty() && out.model.params.empty()) {
    inst.error = out.source_error;
  } else if (inst.ranks[0]->engine_table) {
    LayOutEngineTables(out.model, m.id, resolutions, &inst);
  } else if (inst.options.load_format == LoadFormat::kFallbackOnly) {
    inst.error = ExplicitFallbackOnly(m.id);
  } else {
    absl::StatusOr<std::vector<RankLayout>> layout =
        ExplicitLayout(out.model, inst);
    if (layout.ok()) {
      inst.layout = std::make_shared<const std::vector<RankLayout>>(
          *std::move(layout));
    } else {
      inst.error = std::string(layout.status().message());
    }
  }
  if (inst.error.empty() && !inst.ranks[0]->engine_table) {
    // Engine-table layouts were validated once per resolution, above.
    absl::Status v = ValidateDestination(out.model, *inst.layout, m.id);
    if (!v.ok()) inst.error = absl::StrCat("instance ", m.id, ": ", v.message());
  }
  return inst;
}

// Step 5: the replicas' exchanges, when the options ask for them and some
// instance is given buckets by a partner.
void ChooseStreamExchanges(const std::string& stream,
                           const SourcePlanner& source_planner,
                           StreamPlan* out) {
  std::vector<Exchange> exchanges = ChooseExchanges(
      source_planner, out->source_layouts, out->planner_instances, out->plan,
      [&](int32_t k) -> const InstancePlan& { return out->DirectPlan(k); });
  if (std::any_of(exchanges.begin(), exchanges.end(),
                  [](const Exchange& e) { return e.partner >= 0; })) {
    out->exchanges = std::move(exchanges);
  }
  for (size_t k = 0; k < out->exchanges.size(); ++k) {
    const Exchange& e = out->exchanges[k];
    if (e.partner < 0) continue;
    LOG(INFO) << "stream " << stream << ": instance "
              << out->plan.instances[k].instance << " is given "
              << e.buckets.size() << " buckets (" << e.bytes
              << " bytes) by " << out->plan.instances[e.partner].instance;
  }
}

// Step 4: plans the instances without an error from the sources, and
// where each one's relay runs; on a planner error, every instance fails
// with the sources' error.
void PlanInstancesFromSources(const Registry::StreamSnapshot& s,
                              const PlanCacheOptions& cache_options,
                              StreamPlan* out) {
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
    return;
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
    ChooseStreamExchanges(s.name, source_planner, out);
  }
  LOG(INFO) << "planned stream " << s.name << " (epoch " << s.epoch << "): "
            << out->plan.instances.size() << " instances, digest " << std::hex
            << out->plan.digest;
}

}  // namespace

std::shared_ptr<const StreamPlan> BuildStreamPlan(
    const Registry::StreamSnapshot& s, const StreamPlan* previous,
    const PlanCacheOptions& cache_options) {
  auto out = std::make_shared<StreamPlan>();
  out->stream = s.name;
  out->epoch = s.epoch;
  out->model = StreamModel(s);
  out->sources = s.sources;
  // 1: the sources in the model's indices, or why they are not all there.
  if (!s.sources_complete()) {
    out->source_error = MissingSourcesError(s);
  } else {
    out->source_layouts = SourceLayouts(s, out->model);
  }
  // 2, 3: every complete instance laid out, reusing resolutions.
  std::vector<Resolved> resolutions = PreviousResolutions(previous, out->model);
  for (const Registry::InstanceMembers& m : s.instances) {
    if (!m.complete()) continue;
    out->instances.push_back(LayOutInstance(*out, m, &resolutions));
  }
  if (!out->source_error.empty()) return out;
  // 3c: FP8 in flight's derived parameters and quantizer ranks.
  AddQuantizerRanks(cache_options.node, cache_options.devices, out.get());
  // 4, 5: the plan, relays and exchanges.
  PlanInstancesFromSources(s, cache_options, out.get());
  return out;
}

absl::StatusOr<std::shared_ptr<const StreamPlan>> PlanCache::Get(
    const std::string& stream) {
  // A hit compares epochs only: every trainer rank's BeginVersion asks, and
  // a snapshot copies every rank of the stream (256 x 1,024 per version of
  // a fleet).
  absl::StatusOr<uint64_t> epoch = registry_->EpochOf(stream);
  if (epoch.ok()) {
    absl::MutexLock lock(&mu_);
    auto it = cache_.find(stream);
    if (it != cache_.end() && it->second->epoch == *epoch) {
      if (metrics_ != nullptr) metrics_->PlanLookup(/*hit=*/true);
      return it->second;
    }
  }
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
