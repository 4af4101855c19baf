#include "core/explain.h"

#include <algorithm>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/region_copy.h"

namespace ferry {

std::string HumanBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  if (u == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.2f %s", v, units[u]);
}

InstanceExplanation ExplainInstance(const ModelSpec& model,
                                    const std::vector<RankLayout>& sources,
                                    const Plan& plan, size_t instance,
                                    const std::vector<RankLayout>& layout,
                                    const ResolvedInstance* resolved) {
  const InstancePlan& ip = plan.instances[instance];
  InstanceExplanation e = ExplainInstance(model, sources, ip, layout, resolved);
  if (ip.relay_from >= 0) e.relay_from = plan.instances[ip.relay_from].instance;
  return e;
}

InstanceExplanation ExplainInstance(const ModelSpec& model,
                                    const std::vector<RankLayout>& sources,
                                    const InstancePlan& ip,
                                    const std::vector<RankLayout>& layout,
                                    const ResolvedInstance* resolved) {
  InstanceExplanation e;
  e.instance = ip.instance;
  e.received_bytes = ip.bytes;
  e.copies = static_cast<int64_t>(ip.copies.size());
  e.buckets = static_cast<int64_t>(ip.buckets.size());

  // Which checkpoint params the instance holds, and how.
  std::vector<int> held(model.params.size(), 0);  // 0 no, 1 direct, 2 staging
  for (const RankLayout& r : layout) {
    for (const Piece& p : r.pieces) {
      held[p.param] = std::max(held[p.param],
                               (p.buffer & kStagingBufferBit) ? 2 : 1);
    }
  }
  std::map<int32_t, const ParamDecision*> decision_of;
  if (resolved != nullptr && !resolved->ranks.empty()) {
    for (const ParamDecision& d : resolved->ranks.front().decisions) {
      for (int32_t p : d.checkpoint_params) decision_of.emplace(p, &d);
    }
  }
  std::vector<int64_t> received(model.params.size(), 0);
  std::vector<std::set<int32_t>> srcs(model.params.size());
  std::map<int32_t, int64_t> per_source;
  std::vector<std::set<int32_t>> fan_in(layout.size());
  std::map<int32_t, std::set<int32_t>> fan_out;
  for (const Copy& c : ip.copies) {
    const int32_t src = sources[c.src_rank].rank;
    received[c.param] += c.bytes;
    srcs[c.param].insert(src);
    per_source[src] += c.bytes;
    fan_in[c.dst_rank].insert(src);
    fan_out[src].insert(c.dst_rank);
  }
  for (size_t p = 0; p < model.params.size(); ++p) {
    if (held[p] == 0) continue;
    ParamExplanation pe;
    pe.param = model.params[p].name;
    pe.param_bytes = BoxBytes(FullBox(model.params[p].shape),
                              model.params[p].dtype);
    pe.received_bytes = received[p];
    pe.source_ranks.assign(srcs[p].begin(), srcs[p].end());
    auto d = decision_of.find(static_cast<int32_t>(p));
    if (d != decision_of.end()) {
      pe.engine_name = d->second->engine_name;
      pe.resolution = d->second->resolution;
      pe.reason = d->second->reason;
    } else {
      pe.resolution = held[p] == 2 ? Resolution::kFallback : Resolution::kDirect;
      pe.reason = held[p] == 2 ? "registered as a full tensor in staging"
                               : "registered pieces";
    }
    e.param_bytes += pe.param_bytes;
    if (pe.resolution != Resolution::kFallback) e.direct_bytes += pe.param_bytes;
    e.params.push_back(std::move(pe));
  }
  e.direct_coverage =
      e.param_bytes ? static_cast<double>(e.direct_bytes) / e.param_bytes : 0;
  e.bytes_per_source_rank.assign(per_source.begin(), per_source.end());
  for (const auto& s : fan_in) {
    e.max_fan_in = std::max<int32_t>(e.max_fan_in, s.size());
  }
  for (const auto& [src, dsts] : fan_out) {
    e.max_fan_out = std::max<int32_t>(e.max_fan_out, dsts.size());
  }
  return e;
}

std::string FormatExplanation(const InstanceExplanation& e,
                              size_t max_params) {
  std::string out = absl::StrFormat(
      "instance %s%s\n"
      "  parameters       %d\n"
      "  direct coverage  %.1f%% (%s of %s resolved direct or fused)\n"
      "  received         %s in %d copies, %d buckets\n"
      "  max fan-in       %d trainer ranks per engine rank\n"
      "  max fan-out      %d engine ranks per trainer rank\n",
      e.instance,
      e.relay_from.empty() ? "" : absl::StrCat(" (relayed from ", e.relay_from, ")"),
      e.params.size(), 100.0 * e.direct_coverage, HumanBytes(e.direct_bytes),
      HumanBytes(e.param_bytes), HumanBytes(e.received_bytes), e.copies,
      e.buckets, e.max_fan_in, e.max_fan_out);
  if (!e.bytes_per_source_rank.empty()) {
    std::vector<std::string> parts;
    for (const auto& [rank, bytes] : e.bytes_per_source_rank) {
      parts.push_back(absl::StrCat(rank, ":", HumanBytes(bytes)));
    }
    absl::StrAppend(&out, "  per trainer rank ", absl::StrJoin(parts, "  "),
                    "\n");
  }
  absl::StrAppend(&out, "\n", absl::StrFormat("  %-52s %-9s %11s  %-10s %s\n",
                                              "PARAMETER", "HOW", "BYTES",
                                              "FROM", "WHY"));
  size_t shown = 0;
  for (const ParamExplanation& p : e.params) {
    if (max_params != 0 && shown++ >= max_params) {
      absl::StrAppend(&out, "  ... ", e.params.size() - max_params,
                      " more (use --all)\n");
      break;
    }
    std::string from = p.source_ranks.empty()
                           ? "relay"
                           : absl::StrCat("r", absl::StrJoin(p.source_ranks, ","));
    if (from.size() > 10) from = absl::StrCat(p.source_ranks.size(), " ranks");
    absl::StrAppend(&out, absl::StrFormat("  %-52s %-9s %11s  %-10s %s\n",
                                          p.param, ResolutionName(p.resolution),
                                          HumanBytes(p.param_bytes), from,
                                          p.reason));
  }
  return out;
}

std::string ExplanationToJson(const InstanceExplanation& e) {
  nlohmann::json j;
  j["instance"] = e.instance;
  j["relay_from"] = e.relay_from;
  j["param_bytes"] = e.param_bytes;
  j["direct_bytes"] = e.direct_bytes;
  j["direct_coverage"] = e.direct_coverage;
  j["received_bytes"] = e.received_bytes;
  j["max_fan_in"] = e.max_fan_in;
  j["max_fan_out"] = e.max_fan_out;
  j["copies"] = e.copies;
  j["buckets"] = e.buckets;
  nlohmann::json per = nlohmann::json::object();
  for (const auto& [rank, bytes] : e.bytes_per_source_rank) {
    per[std::to_string(rank)] = bytes;
  }
  j["bytes_per_source_rank"] = per;
  nlohmann::json params = nlohmann::json::array();
  for (const ParamExplanation& p : e.params) {
    params.push_back({{"param", p.param},
                      {"engine_name", p.engine_name},
                      {"resolution", ResolutionName(p.resolution)},
                      {"reason", p.reason},
                      {"param_bytes", p.param_bytes},
                      {"received_bytes", p.received_bytes},
                      {"source_ranks", p.source_ranks}});
  }
  j["params"] = params;
  return j.dump(2);
}

}  // namespace ferry
