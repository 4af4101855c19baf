#include "daemon/api/inspection_service.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/version.h"
#include "core/explain.h"
#include "core/limits.h"
#include "core/region_copy.h"
#include "daemon/api/call_deadline.h"
#include "daemon/lifecycle/adapters.h"
#include "proto/convert.h"
#include "proto/grpc_status.h"
#include "proto/request_limits.h"

namespace ferry {
namespace {

v1::Resolution ResolutionToProto(Resolution r) {
  switch (r) {
    case Resolution::kDirect:
      return v1::RESOLUTION_DIRECT;
    case Resolution::kFused:
      return v1::RESOLUTION_FUSED;
    case Resolution::kFallback:
      return v1::RESOLUTION_FALLBACK;
    case Resolution::kQuantized:
      return v1::RESOLUTION_QUANTIZED;
  }
  return v1::RESOLUTION_UNSPECIFIED;
}

// Bytes and source ranks per (destination rank, checkpoint parameter), from
// the instance's copies from the sources (StreamPlan::DirectPlan).
struct Received {
  int64_t bytes = 0;
  std::set<int32_t> sources;
};

}  // namespace

InspectionService::InspectionService(const Registry* registry,
                                     PlanCache* plans,
                                     const VersionCoordinator* coordinator,
                                     std::string node)
    : registry_(registry),
      plans_(plans),
      coordinator_(coordinator),
      node_(std::move(node)) {}

grpc::Status InspectionService::ListParticipants(
    grpc::ServerContext*, const v1::ListParticipantsRequest* request,
    v1::ListParticipantsResponse* response) {
  absl::Status s = CheckOptionalName("stream", request->stream());
  if (s.ok()) s = CheckOptionalName("node", request->node());
  if (!s.ok()) return ToGrpcStatus(s);
  for (const auto& p : registry_->List()) {
    if (!request->stream().empty() && p->stream != request->stream()) continue;
    if (!request->node().empty() && p->node != request->node()) continue;
    v1::ParticipantInfo* info = response->add_participants();
    info->set_participant_id(p->id);
    info->set_stream(p->stream);
    info->set_node(p->node);
    *info->mutable_device() = p->device;
    info->set_pid(p->pid);
    if (p->role == Role::kSource) {
      info->mutable_source()->set_rank(p->rank);
      info->mutable_source()->set_world_size(p->world_size);
    } else {
      v1::DestinationRankInfo* d = info->mutable_destination();
      d->set_instance_id(p->instance_id);
      d->set_tp_rank(p->tp_rank);
      d->set_tp_size(p->tp_size);
      d->set_engine_parameter_count(p->engine_params->size());
      d->set_subscribed(coordinator_->IsSubscribed(p->channel_id()));
      d->set_offloaded(p->memory != nullptr && p->memory->released());
      if (p->adapter != nullptr) {
        d->set_adapter_name(p->adapter->name);
        d->set_engine_participant_id(p->adapter->base_id);
      }
    }
    info->set_region_count(p->memory->size());
    info->set_registered_bytes(p->memory->total_bytes());
    info->set_piece_count(p->engine_table ? p->engine_params->size()
                                          : p->pieces.size());
    info->set_registered_unix_ms(absl::ToUnixMillis(p->registered_at));
    // An adapter's rank lives as long as its engine rank.
    info->set_lease_remaining_ms(absl::ToInt64Milliseconds(
        registry_->LeaseRemaining(p->channel_id())));
  }
  return grpc::Status::OK;
}

grpc::Status InspectionService::ListStreams(
    grpc::ServerContext* context, const v1::ListStreamsRequest* request,
    v1::ListStreamsResponse* response) {
  if (absl::Status s = CheckOptionalName("stream", request->stream());
      !s.ok()) {
    return ToGrpcStatus(s);
  }
  std::vector<std::string> names;
  const bool all = request->stream().empty();
  if (all) {
    names = registry_->StreamNames();
  } else {
    names.push_back(request->stream());
  }
  std::map<std::string, std::vector<v1::AdapterInfo>> adapters_by_instance =
      AdaptersByInstance(*registry_, *coordinator_);
  for (const std::string& name : names) {
    if (CallExpired(context)) {
      return ToGrpcStatus(Expired("ListStreams", "before every stream was "
                                  "listed"));
    }
    absl::StatusOr<Registry::StreamSnapshot> snap = registry_->Snapshot(name);
    // A stream whose last participant left since StreamNames is gone.
    if (!snap.ok() && all && absl::IsNotFound(snap.status())) continue;
    if (!snap.ok()) return ToGrpcStatus(snap.status());
    v1::StreamInfo* info = response->add_streams();
    info->set_name(name);
    info->set_world_size(snap->world_size);
    for (const auto& s : snap->sources) {
      if (s != nullptr) info->add_registered_ranks(s->rank);
    }
    // The model as the sources declare it, kept by the Registry: listing
    // streams never plans (planning a large stream takes seconds).
    absl::StatusOr<Registry::ModelSummary> model = registry_->ModelOf(name);
    if (model.ok()) {
      info->set_parameter_count(model->parameters);
      info->set_model_bytes(model->bytes);
    }
    const StreamSummary summary =
        coordinator_->Summary(name);
    info->set_latest_committed_version(summary.latest_committed);
    info->set_version_in_progress(summary.in_progress);
    if (!summary.delivery.instance_id().empty()) {
      *info->mutable_delivery() = summary.delivery;
    }
    for (const Registry::InstanceMembers& m : snap->instances) {
      v1::InstanceInfo* inst = info->add_instances();
      inst->set_instance_id(m.id);
      inst->set_tp_size(m.tp_size);
      for (const auto& r : m.ranks) {
        if (r != nullptr) inst->add_registered_tp_ranks(r->tp_rank);
      }
      *inst->mutable_status() =
          coordinator_->InstanceStatusOf(m.id, m.held_version);
      const OffloadRuns::HostCopyInfo copy =
          coordinator_->offloads().HostCopyOf(m.id);
      inst->set_host_copy_bytes(copy.bytes);
      inst->set_host_copy_version(copy.version);
      auto adapters = adapters_by_instance.find(m.id);
      if (adapters == adapters_by_instance.end()) continue;
      for (v1::AdapterInfo& a : adapters->second) {
        inst->add_adapter_names(a.name());
        *inst->add_adapters() = std::move(a);
      }
    }
  }
  return grpc::Status::OK;
}

namespace {

// ExplainPlan, step 1: the request's names and tp_rank are well formed.
absl::Status CheckExplainRequest(const v1::ExplainPlanRequest& request) {
  absl::Status s = ValidateName("instance_id", request.instance_id());
  if (s.ok()) s = CheckOptionalName("stream", request.stream());
  if (s.ok() && request.has_tp_rank() &&
      (request.tp_rank() < 0 || request.tp_rank() >= Limits::kMaxTpSize)) {
    s = absl::InvalidArgumentError(absl::StrCat(
        "tp_rank ", request.tp_rank(), " is outside [0, ", Limits::kMaxTpSize,
        ")"));
  }
  return s;
}

// The stream and the instance on it that ExplainPlan explains.
struct ExplainTarget {
  std::string stream;
  std::string instance_id;
};

// ExplainPlan, step 2: the instance's stream, or on an adapter stream the
// adapter's own instance there.
absl::StatusOr<ExplainTarget> FindExplainTarget(
    const Registry& registry, const VersionCoordinator& coordinator,
    const v1::ExplainPlanRequest& request) {
  absl::StatusOr<std::string> stream =
      registry.StreamOfInstance(request.instance_id());
  if (!stream.ok()) return stream.status();
  const std::string& instance_id = request.instance_id();
  if (request.stream().empty() || request.stream() == *stream) {
    return ExplainTarget{*stream, instance_id};
  }
  // An adapter stream: the plan of the adapter's own instance on it.
  std::string found;
  for (const v1::AdapterInfo& a :
       AdaptersOf(registry, coordinator, instance_id)) {
    if (a.stream() == request.stream()) found = a.stream_instance_id();
  }
  if (found.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "instance ", instance_id, " follows stream ", *stream,
        " and has no adapter on stream ", request.stream()));
  }
  return ExplainTarget{request.stream(), found};
}

// ExplainPlan, step 3 when the plan lacks the instance: the error, naming
// the tp ranks not registered.
absl::Status NotCompletelyRegistered(const Registry& registry,
                                     const ExplainTarget& target) {
  absl::StatusOr<Registry::StreamSnapshot> snap =
      registry.Snapshot(target.stream);
  std::string missing;
  if (snap.ok()) {
    for (const auto& m : snap->instances) {
      if (m.id != target.instance_id) continue;
      std::vector<int32_t> gone;
      for (int32_t r = 0; r < m.tp_size; ++r) {
        if (r >= static_cast<int32_t>(m.ranks.size()) || !m.ranks[r]) {
          gone.push_back(r);
        }
      }
      missing = absl::StrCat(": tp ranks [", absl::StrJoin(gone, ", "),
                             "] of tp_size ", m.tp_size,
                             " are not registered");
    }
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "instance ", target.instance_id, " is not completely registered",
      missing));
}

// ExplainPlan, step 4: one row per (engine parameter, tp rank), sorted,
// with the bytes and source ranks of the instance's copies from the
// sources; a deadline that passes meanwhile ends it.
absl::StatusOr<std::vector<v1::ParameterPlan>> ParameterRows(
    const StreamPlan& plan, const PlannedInstance& inst,
    const InstancePlan& direct, grpc::ServerContext* context,
    const std::string& what) {
  // Long loops look at the deadline every so many steps.
  constexpr size_t kCheckEvery = 4096;
  size_t steps = 0;
  auto expired = [&] { return ++steps % kCheckEvery == 0 && CallExpired(context); };
  std::map<std::pair<int32_t, int32_t>, Received> received;
  for (const Copy& c : direct.copies) {
    if (expired()) return Expired(what, "while rows were built");
    Received& r = received[{c.dst_rank, c.param}];
    r.bytes += c.bytes;
    r.sources.insert(plan.source_layouts[c.src_rank].rank);
  }
  // FP8 in flight: the derived tensors of each quantized checkpoint
  // parameter, looked up per row (Kimi-K2 quantizes 60,000 tensors).
  std::map<int32_t, std::vector<const QuantizedParam*>> quantized;
  if (plan.fp8 != nullptr) {
    for (const QuantizedParam& q : plan.fp8->quantized()) {
      quantized[q.param].push_back(&q);
    }
  }
  std::vector<v1::ParameterPlan> rows;
  auto add_row = [&](const std::string& name, int32_t tp, Resolution res,
                     const std::string& reason,
                     const std::vector<int32_t>& params) {
    v1::ParameterPlan row;
    row.set_name(name);
    row.set_tp_rank(tp);
    row.set_resolution(ResolutionToProto(res));
    std::string why = reason;
    std::set<int32_t> sources;
    int64_t bytes = 0;
    auto count = [&](int32_t p) {
      auto it = received.find({tp, p});
      if (it == received.end()) return;
      bytes += it->second.bytes;
      sources.insert(it->second.sources.begin(), it->second.sources.end());
    };
    for (int32_t p : params) {
      row.add_checkpoint_parameters(plan.model.params[p].name);
      count(p);
      // FP8 in flight: what moves are the derived FP8 and scale tensors,
      // from the node that quantizes them.
      if (res != Resolution::kQuantized) continue;
      auto derived = quantized.find(p);
      if (derived == quantized.end()) continue;
      for (const QuantizedParam* q : derived->second) {
        count(q->fp8_param);
        count(q->scale_param);
        if (!q->split()) {
          absl::StrAppend(&why, "; quantized on node ", q->node);
          continue;
        }
        // Split over trainer nodes: each quantizes its parts.
        std::set<std::string> nodes;
        for (const QuantizedPart& part : q->parts) nodes.insert(part.node);
        absl::StrAppend(&why, "; split over trainer nodes, quantized on ",
                        absl::StrJoin(nodes, ", "),
                        " with block amaxes combined, scales on ", q->node);
      }
    }
    row.set_reason(why);
    row.set_bytes(bytes);
    for (int32_t s : sources) row.add_source_ranks(s);
    rows.push_back(std::move(row));
  };
  for (size_t tp = 0; tp < inst.layout->size(); ++tp) {
    if (CallExpired(context)) return Expired(what, "while rows were built");
    if (inst.resolved != nullptr) {
      for (const ParamDecision& d : inst.resolved->ranks[tp].decisions) {
        add_row(d.engine_name, tp, d.resolution, d.reason,
                d.checkpoint_params);
      }
    } else {
      std::set<int32_t> params;
      for (const Piece& p : (*inst.layout)[tp].pieces) params.insert(p.param);
      for (int32_t p : params) {
        add_row(plan.model.params[p].name, tp, Resolution::kDirect,
                "explicit pieces", {p});
      }
    }
  }
  std::sort(rows.begin(), rows.end(),
            [](const v1::ParameterPlan& a, const v1::ParameterPlan& b) {
              return std::make_pair(a.name(), a.tp_rank()) <
                     std::make_pair(b.name(), b.tp_rank());
            });
  return rows;
}

// ExplainPlan, step 5: the totals over every row, and the rows the request
// asks for (up to Limits::kMaxExplainRows) in the response.
void AddRowsAndTotals(std::vector<v1::ParameterPlan> rows,
                      const v1::ExplainPlanRequest& request,
                      v1::ExplainPlanResponse* response) {
  v1::PlanTotals* totals = response->mutable_totals();
  for (v1::ParameterPlan& row : rows) {
    totals->set_total_bytes(totals->total_bytes() + row.bytes());
    if (row.resolution() == v1::RESOLUTION_FALLBACK) {
      totals->set_fallback_bytes(totals->fallback_bytes() + row.bytes());
    } else {
      totals->set_direct_bytes(totals->direct_bytes() + row.bytes());
    }
    const bool wanted =
        !request.has_tp_rank() || request.tp_rank() == row.tp_rank();
    if (!wanted) continue;
    // A bounded response: totals cover every row, the list the first ones.
    if (response->parameters_size() >= Limits::kMaxExplainRows) {
      response->set_parameters_omitted(response->parameters_omitted() + 1);
      continue;
    }
    *response->add_parameters() = std::move(row);
  }
  totals->set_direct_byte_coverage(
      totals->total_bytes() == 0
          ? 1.0
          : static_cast<double>(totals->direct_bytes()) /
                totals->total_bytes());
}

// ExplainPlan, step 6: fan-in, fan-out and bytes per source rank as core
// explains them, over the instance's copies from the sources (a relayed
// replica's: what it reads when its relay fails).
void AddFanTotals(const StreamPlan& plan, const PlannedInstance& inst,
                  const InstancePlan& direct, v1::PlanTotals* totals) {
  const InstanceExplanation e =
      ExplainInstance(plan.model, plan.source_layouts, direct, *inst.layout,
                      inst.resolved.get());
  for (const auto& [rank, bytes] : e.bytes_per_source_rank) {
    v1::SourceRankBytes* b = totals->add_bytes_per_source_rank();
    b->set_rank(rank);  // core reports source ranks, not indices
    b->set_bytes(bytes);
  }
  totals->set_max_fan_in(e.max_fan_in);
  totals->set_max_fan_out(e.max_fan_out);
  totals->set_copy_count(e.copies);
}

}  // namespace

grpc::Status InspectionService::ExplainPlan(
    grpc::ServerContext* context, const v1::ExplainPlanRequest* request,
    v1::ExplainPlanResponse* response) {
  if (absl::Status s = CheckExplainRequest(*request); !s.ok()) {
    return ToGrpcStatus(s);
  }
  absl::StatusOr<ExplainTarget> target =
      FindExplainTarget(*registry_, *coordinator_, *request);
  if (!target.ok()) return ToGrpcStatus(target.status());
  absl::StatusOr<std::shared_ptr<const StreamPlan>> got =
      plans_->Get(target->stream);
  if (!got.ok()) return ToGrpcStatus(got.status());
  const std::string what = absl::StrCat("ExplainPlan(", target->instance_id,
                                        ")");
  if (CallExpired(context)) {
    return ToGrpcStatus(Expired(what, "while the stream was planned"));
  }
  const StreamPlan& plan = **got;
  const int32_t index = plan.FindInstance(target->instance_id);
  if (index < 0) return ToGrpcStatus(NotCompletelyRegistered(*registry_, *target));
  const PlannedInstance& inst = plan.instances[index];
  if (!plan.source_error.empty() &&
      (plan.source_error.find("not registered") != std::string::npos ||
       plan.source_error.find("no source") != std::string::npos)) {
    return ToGrpcStatus(absl::FailedPreconditionError(plan.source_error));
  }
  if (!inst.error.empty()) {
    return ToGrpcStatus(absl::InvalidArgumentError(inst.error));
  }
  const InstancePlan& direct = plan.DirectPlan(inst.plan_index);
  response->set_stream(target->stream);
  response->set_instance_id(inst.id);
  response->set_plan_digest(
      absl::StrCat(absl::Hex(plan.plan.digest, absl::kZeroPad16)));
  if (const Exchange* e = plan.ExchangeOf(inst.plan_index)) {
    response->set_exchange_partner(plan.plan.instances[e->partner].instance);
    response->set_exchanged_bytes(e->bytes);
  }
  absl::StatusOr<std::vector<v1::ParameterPlan>> rows =
      ParameterRows(plan, inst, direct, context, what);
  if (!rows.ok()) return ToGrpcStatus(rows.status());
  AddRowsAndTotals(*std::move(rows), *request, response);
  AddFanTotals(plan, inst, direct, response->mutable_totals());
  return grpc::Status::OK;
}

grpc::Status InspectionService::GetProgress(
    grpc::ServerContext*, const v1::GetProgressRequest* request,
    v1::GetProgressResponse* response) {
  absl::Status s = ValidateName("stream", request->stream());
  if (!s.ok()) return ToGrpcStatus(s);
  if (request->version() < 0) {
    return ToGrpcStatus(absl::InvalidArgumentError(absl::StrCat(
        "version ", request->version(), " is negative")));
  }
  absl::StatusOr<v1::GetProgressResponse> progress =
      coordinator_->Progress(request->stream(), request->version());
  if (!progress.ok()) return ToGrpcStatus(progress.status());
  *response = *std::move(progress);
  return grpc::Status::OK;
}

grpc::Status InspectionService::ListVersions(
    grpc::ServerContext*, const v1::ListVersionsRequest* request,
    v1::ListVersionsResponse* response) {
  absl::Status s = ValidateName("stream", request->stream());
  if (!s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<std::vector<v1::GetProgressResponse>> history =
      coordinator_->History(request->stream());
  if (!history.ok()) return ToGrpcStatus(history.status());
  for (v1::GetProgressResponse& v : *history) {
    *response->add_versions() = std::move(v);
  }
  return grpc::Status::OK;
}

grpc::Status InspectionService::GetHealth(grpc::ServerContext*,
                                          const v1::GetHealthRequest*,
                                          v1::GetHealthResponse* response) {
  response->set_node(node_);
  response->set_role(v1::DAEMON_ROLE_COORDINATOR);
  response->set_coordinator_node(node_);
  response->set_daemon_version(kDaemonVersion);
  response->set_uptime_ms(absl::ToInt64Milliseconds(absl::Now() - started_));
  response->set_participant_count(registry_->participant_count());
  if (fill_membership_) fill_membership_(response);
  return grpc::Status::OK;
}

}  // namespace ferry
