#include "client/ferryctl/format.h"

#include <algorithm>
#include <map>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "core/explain.h"

namespace ferry {
namespace {

std::string DeviceName(const v1::Device& d) {
  switch (d.kind()) {
    case v1::DEVICE_KIND_HOST:
      return "host";
    case v1::DEVICE_KIND_CUDA:
      return absl::StrCat("cuda:", d.cuda_ordinal());
    default:
      return "?";
  }
}

std::string ResolutionShort(v1::Resolution r) {
  switch (r) {
    case v1::RESOLUTION_DIRECT:
      return "direct";
    case v1::RESOLUTION_FUSED:
      return "fused";
    case v1::RESOLUTION_FALLBACK:
      return "fallback";
    case v1::RESOLUTION_QUANTIZED:
      return "quantized";
    default:
      return "?";
  }
}

std::string RankList(const google::protobuf::RepeatedField<int32_t>& ranks) {
  if (ranks.empty()) return "-";
  std::string s = absl::StrCat("r", absl::StrJoin(ranks, ","));
  if (s.size() > 12) s = absl::StrCat(ranks.size(), " ranks");
  return s;
}

}  // namespace

std::string HumanDuration(int64_t ms) {
  if (ms < 1000) return absl::StrCat(ms, "ms");
  if (ms < 60000) return absl::StrFormat("%.1fs", ms / 1000.0);
  const int64_t s = ms / 1000;
  if (s < 3600) return absl::StrFormat("%dm%02ds", s / 60, s % 60);
  return absl::StrFormat("%dh%02dm", s / 3600, (s / 60) % 60);
}

std::string InstanceStateName(const v1::InstanceStatus& status) {
  std::string name =
      v1::InstanceState_IsValid(status.state())
          ? std::string(absl::StripPrefix(
                v1::InstanceState_Name(status.state()), "INSTANCE_STATE_"))
          : absl::StrCat("STATE_", static_cast<int>(status.state()));
  if (status.state() == v1::INSTANCE_STATE_ABORTED) {
    absl::StrAppend(&name, status.dirty() ? " (dirty)" : " (clean)");
  }
  return name;
}

std::string FormatParticipants(const v1::ListParticipantsResponse& response) {
  if (response.participants().empty()) return "no participants registered\n";
  std::string out = absl::StrFormat("%-12s %-11s %-18s %-8s %-6s %7s %10s %6s %7s  %s\n",
                                    "STREAM", "ROLE", "WHERE", "NODE", "DEVICE",
                                    "REGIONS", "BYTES", "PIECES", "LEASE", "ID");
  for (const v1::ParticipantInfo& p : response.participants()) {
    std::string role, where;
    if (p.has_source()) {
      role = "source";
      where = absl::StrCat("rank ", p.source().rank(), "/", p.source().world_size());
    } else if (p.has_destination()) {
      const v1::DestinationRankInfo& d = p.destination();
      role = d.offloaded()                ? "offloaded"
             : !d.adapter_name().empty() ? "adapter"
             : d.subscribed()            ? "destination"
                                         : "dest(unsub)";
      where = absl::StrCat(d.instance_id(), " tp ", d.tp_rank(), "/", d.tp_size());
    } else {
      role = "?";
    }
    absl::StrAppend(
        &out, absl::StrFormat("%-12s %-11s %-18s %-8s %-6s %7d %10s %6d %7s  %s\n",
                              p.stream(), role, where, p.node(),
                              DeviceName(p.device()), p.region_count(),
                              HumanBytes(p.registered_bytes()), p.piece_count(),
                              HumanDuration(p.lease_remaining_ms()),
                              p.participant_id()));
  }
  return out;
}

std::string FormatStreams(const v1::ListStreamsResponse& response) {
  if (response.streams().empty()) return "no streams registered\n";
  std::string out;
  for (const v1::StreamInfo& s : response.streams()) {
    const bool complete = s.registered_ranks_size() == s.world_size();
    absl::StrAppend(
        &out,
        absl::StrFormat(
            "stream %s: %s, %d parameters, %s; latest "
            "committed v%d; in progress: %s\n",
            s.name(),
            s.world_size() == 0
                ? std::string("no source ranks yet")
                : absl::StrCat(s.registered_ranks_size(), "/", s.world_size(),
                               " source ranks", complete ? "" : " (INCOMPLETE)"),
            s.parameter_count(),
            HumanBytes(s.model_bytes()), s.latest_committed_version(),
            s.version_in_progress() > 0
                ? absl::StrCat("v", s.version_in_progress())
                : std::string("none")));
    if (s.instances().empty()) {
      absl::StrAppend(&out, "  (no instances)\n");
      continue;
    }
    absl::StrAppend(&out, absl::StrFormat("  %-16s %-7s %-18s %7s %5s  %s\n",
                                          "INSTANCE", "RANKS", "STATE",
                                          "VERSION", "HOLDS", "NOTE"));
    for (const v1::InstanceInfo& i : s.instances()) {
      const v1::InstanceStatus& st = i.status();
      std::string note;
      if (i.registered_tp_ranks_size() < i.tp_size()) {
        note = "waiting for tp ranks to register";
      } else if (st.state() == v1::INSTANCE_STATE_ABORTED) {
        note = st.abort_reason();
      } else if (!st.waiting_on_tp_ranks().empty()) {
        note = absl::StrCat("waiting on tp ranks ",
                            absl::StrJoin(st.waiting_on_tp_ranks(), ","));
      } else if (!st.waiting_reason().empty()) {
        note = st.waiting_reason();
      }
      if (st.state() == v1::INSTANCE_STATE_OFFLOADED) {
        absl::StrAppend(
            &note, note.empty() ? "" : "; ",
            i.host_copy_bytes() > 0
                ? absl::StrCat("host copy ", HumanBytes(i.host_copy_bytes()),
                               " of version ", i.host_copy_version())
                : std::string("no host copy"));
      }
      if (!i.adapter_names().empty()) {
        absl::StrAppend(&note, note.empty() ? "" : "; ", "adapters ",
                        absl::StrJoin(i.adapter_names(), ","));
      }
      absl::StrAppend(
          &out, absl::StrFormat("  %-16s %-7s %-18s %7d %5d  %s\n",
                                i.instance_id(),
                                absl::StrCat(i.registered_tp_ranks_size(), "/",
                                             i.tp_size()),
                                InstanceStateName(st), st.version(),
                                st.committed_version(), note));
    }
    if (s.has_delivery()) {
      absl::StrAppend(&out, "  ", s.delivery().settled() ? "last " : "",
                      FormatDelivery(s.delivery(), 20), "\n");
    }
  }
  return out;
}

std::string FormatAdapters(const v1::ListStreamsResponse& response,
                           const std::string& instance) {
  std::string out = absl::StrFormat("%-16s %-12s %-20s %7s %-10s %10s\n",
                                    "INSTANCE", "ADAPTER", "STREAM", "VERSION",
                                    "STATE", "BYTES");
  int n = 0;
  for (const v1::StreamInfo& s : response.streams()) {
    for (const v1::InstanceInfo& i : s.instances()) {
      if (!instance.empty() && i.instance_id() != instance) continue;
      for (const v1::AdapterInfo& a : i.adapters()) {
        ++n;
        std::string state = InstanceStateName(a.status());
        if (a.status().state() == v1::INSTANCE_STATE_IDLE &&
            !a.status().waiting_reason().empty()) {
          state = "waiting";
        }
        absl::StrAppend(
            &out, absl::StrFormat("%-16s %-12s %-20s %7d %-10s %10s\n",
                                  i.instance_id(), a.name(), a.stream(),
                                  a.status().committed_version(), state,
                                  HumanBytes(a.bytes())));
      }
    }
  }
  if (n == 0) {
    return instance.empty() ? "no adapters loaded\n"
                            : absl::StrCat("instance ", instance,
                                           " has no adapters loaded\n");
  }
  return out;
}

std::string FormatPlan(const v1::ExplainPlanResponse& r, size_t max_rows) {
  const v1::PlanTotals& t = r.totals();
  std::string out = absl::StrFormat(
      "instance %s (stream %s)  plan %s\n"
      "  parameters       %d (per rank)\n"
      "  direct coverage  %.1f%% (%s of %s written straight into live "
      "memory)\n"
      "  fallback         %s through the engine's loader\n"
      "  received         %s per version in %d copies\n"
      "  max fan-in       %d trainer ranks per engine rank\n"
      "  max fan-out      %d engine ranks per trainer rank\n",
      r.instance_id(), r.stream(),
      r.plan_digest().empty() ? "-" : r.plan_digest().substr(0, 16),
      r.parameters_size(), 100.0 * t.direct_byte_coverage(),
      HumanBytes(t.direct_bytes()), HumanBytes(t.total_bytes()),
      HumanBytes(t.fallback_bytes()), HumanBytes(t.total_bytes()),
      t.copy_count(), t.max_fan_in(), t.max_fan_out());
  if (!t.bytes_per_source_rank().empty()) {
    std::vector<std::string> parts;
    for (const v1::SourceRankBytes& b : t.bytes_per_source_rank()) {
      parts.push_back(absl::StrCat(b.rank(), ":", HumanBytes(b.bytes())));
    }
    absl::StrAppend(&out, "  per trainer rank ", absl::StrJoin(parts, "  "), "\n");
  }
  if (!r.exchange_partner().empty()) {
    absl::StrAppend(&out, "  exchange         ",
                    HumanBytes(r.exchanged_bytes()), " given by ",
                    r.exchange_partner(),
                    " each version (the rest from the trainer)\n");
  }
  if (r.gaps().empty()) {
    absl::StrAppend(&out, "  coverage gaps    none\n");
  } else {
    absl::StrAppend(&out, "  COVERAGE GAPS    ", r.gaps_size(),
                    " (the next version will abort this instance):\n");
    int shown = 0;
    for (const v1::CoverageGap& g : r.gaps()) {
      if (max_rows != 0 && shown++ >= 10) {
        absl::StrAppend(&out, "    ... ", r.gaps_size() - 10, " more\n");
        break;
      }
      std::vector<std::string> dims;
      for (int d = 0; d < g.box().offset_size() && d < g.box().extent_size(); ++d) {
        dims.push_back(absl::StrCat(g.box().offset(d), ":",
                                    g.box().offset(d) + g.box().extent(d)));
      }
      absl::StrAppend(&out, "    tp rank ", g.tp_rank(), ": ", g.parameter(),
                      " [", absl::StrJoin(dims, ", "), "]\n");
    }
  }
  absl::StrAppend(&out, "\n",
                  absl::StrFormat("  %-52s %4s %-8s %11s  %-12s %s\n",
                                  "PARAMETER", "RANK", "HOW", "BYTES", "FROM",
                                  "WHY"));
  size_t shown = 0;
  for (const v1::ParameterPlan& p : r.parameters()) {
    if (max_rows != 0 && shown++ >= max_rows) {
      absl::StrAppend(&out, "  ... ", r.parameters_size() - max_rows,
                      " more (use --all)\n");
      break;
    }
    absl::StrAppend(&out, absl::StrFormat("  %-52s %4d %-8s %11s  %-12s %s\n",
                                          p.name(), p.tp_rank(),
                                          ResolutionShort(p.resolution()),
                                          HumanBytes(p.bytes()),
                                          RankList(p.source_ranks()),
                                          p.reason()));
  }
  return out;
}

std::string FormatHealth(const v1::GetHealthResponse& h) {
  std::string role = "?";
  if (h.role() == v1::DAEMON_ROLE_COORDINATOR) role = "coordinator";
  if (h.role() == v1::DAEMON_ROLE_MEMBER) {
    role = absl::StrCat("member of ", h.coordinator_node());
  }
  std::string out = absl::StrFormat(
      "node %s: %s, ferryd %s, up %s, %d participants\n", h.node(), role,
      h.daemon_version().empty() ? "?" : h.daemon_version(),
      HumanDuration(h.uptime_ms()), h.participant_count());
  if (h.devices().empty()) {
    absl::StrAppend(&out, "  devices   none: ",
                    h.gpu_unavailable_reason().empty()
                        ? "host memory only"
                        : h.gpu_unavailable_reason(),
                    "\n");
  }
  for (const v1::DeviceInfo& d : h.devices()) {
    absl::StrAppend(&out, "  device    ", DeviceName(d.device()), " ", d.name(),
                    " ", HumanBytes(d.memory_bytes()), " ",
                    d.device().cuda_uuid(), "\n");
  }
  absl::StrAppend(&out, "  rails     ",
                  h.rails().empty()
                      ? std::string("one (no --rails)")
                      : absl::StrCat(h.rails_size(), ": ",
                                     absl::StrJoin(h.rails(), ", ")),
                  "\n");
  if (h.peers().empty()) absl::StrAppend(&out, "  peers     none\n");
  for (const v1::PeerHealth& p : h.peers()) {
    absl::StrAppend(&out, "  peer      ", p.node(), " ", p.peer_address(), " ",
                    p.reachable() ? "reachable" : "UNREACHABLE",
                    ", last heartbeat ", HumanDuration(p.last_heartbeat_age_ms()),
                    " ago",
                    p.rails().empty()
                        ? std::string()
                        : absl::StrCat(", ", p.rails_size(), " rails"),
                    "\n");
  }
  if (h.problems().empty()) {
    absl::StrAppend(&out, "  problems  none: healthy\n");
  } else {
    for (const std::string& p : h.problems()) {
      absl::StrAppend(&out, "  PROBLEM   ", p, "\n");
    }
  }
  return out;
}

std::string FormatProgressLine(const v1::GetProgressResponse& p,
                               int bar_width) {
  const double fraction =
      p.bytes_total() > 0
          ? std::min(1.0, static_cast<double>(p.bytes_moved()) / p.bytes_total())
          : (p.instances_total() > 0 &&
                     p.instances_committed() + p.instances_aborted() ==
                         p.instances_total()
                 ? 1.0
                 : 0.0);
  const int filled = static_cast<int>(fraction * bar_width + 0.5);
  std::string bar = std::string(filled, '#') + std::string(bar_width - filled, '.');
  std::string out = absl::StrFormat(
      "%s v%d [%s] %3.0f%%  %s / %s  %.2f GB/s  instances %d/%d committed",
      p.stream(), p.version(), bar, 100.0 * fraction, HumanBytes(p.bytes_moved()),
      HumanBytes(p.bytes_total()), p.throughput_bytes_per_second() / 1e9,
      p.instances_committed(), p.instances_total());
  if (p.instances_aborted() > 0) {
    absl::StrAppend(&out, ", ", p.instances_aborted(), " ABORTED");
  }
  absl::StrAppend(&out, "  ", HumanDuration(p.elapsed_ms()));
  return out;
}

std::string FormatDelivery(const v1::PeerDelivery& d, int bar_width) {
  const double fraction =
      d.bytes_total() > 0
          ? std::min(1.0, static_cast<double>(d.bytes_moved()) / d.bytes_total())
          : (d.settled() ? 1.0 : 0.0);
  const int filled = static_cast<int>(fraction * bar_width + 0.5);
  // Where the bytes come from: a peer instance, or (offload, onload)
  // ferryd's host copy of the instance.
  std::string from;
  if (!d.peer_instance_id().empty()) {
    from = absl::StrCat(" <- ", d.peer_instance_id());
  } else if (d.kind() == "onload") {
    from = d.bytes_total() > 0 ? " <- host copy" : "";
  } else if (d.kind() == "offload") {
    from = d.bytes_total() > 0 ? " -> host copy" : " (weights discarded)";
  }
  std::string out = absl::StrFormat(
      "%s %s%s v%d [%s] %3.0f%%  %s / %s  %.2f GB/s  %s  %s", d.kind(),
      d.instance_id(), from, d.version(),
      std::string(filled, '#') + std::string(bar_width - filled, '.'),
      100.0 * fraction, HumanBytes(d.bytes_moved()), HumanBytes(d.bytes_total()),
      d.throughput_bytes_per_second() / 1e9, InstanceStateName(d.status()),
      HumanDuration(d.elapsed_ms()));
  if (d.status().state() == v1::INSTANCE_STATE_ABORTED) {
    absl::StrAppend(&out, ": ", d.status().abort_reason());
  }
  return out;
}

std::string FormatConfig(
    const std::string& instance,
    const google::protobuf::Map<std::string, std::string>& options) {
  std::map<std::string, std::string> sorted(options.begin(), options.end());
  std::string out = absl::StrCat("instance ", instance, " load options:\n");
  for (const auto& [key, value] : sorted) {
    absl::StrAppend(&out, "  ", key, " = ", value, "\n");
  }
  return out;
}

namespace {

// Delta versions: "40.0 MiB as patches, 1.20 MiB on the wire, 2.0%
// changed"; "" when nothing came as a patch.
std::string PatchNote(int64_t patched, int64_t wire, int64_t changed) {
  if (patched <= 0) return "";
  return absl::StrFormat("%s as patches, %s on the wire, %.1f%% changed",
                         HumanBytes(patched), HumanBytes(wire),
                         100.0 * static_cast<double>(changed) / patched);
}

}  // namespace

std::string FormatProgressInstances(const v1::GetProgressResponse& p) {
  std::string out;
  for (const v1::InstanceProgress& i : p.instances()) {
    const v1::InstanceStatus& s = i.status();
    std::string note;
    if (s.state() == v1::INSTANCE_STATE_ABORTED) {
      note = s.abort_reason();
    } else if (!s.waiting_on_tp_ranks().empty()) {
      note = absl::StrCat("waiting on tp ranks ",
                          absl::StrJoin(s.waiting_on_tp_ranks(), ","));
    } else if (!i.relayed_from().empty()) {
      note = absl::StrCat("relayed from ", i.relayed_from());
    } else if (!i.given_by().empty()) {
      note = absl::StrCat("part given by ", i.given_by());
    }
    const std::string patches =
        PatchNote(i.patched_bytes(), i.patch_bytes(), i.changed_bytes());
    if (!patches.empty()) {
      note = note.empty() ? patches : absl::StrCat(note, "; ", patches);
    }
    absl::StrAppend(&out, absl::StrFormat("  %-16s %-18s %10s / %-10s %s\n",
                                          InstanceLabel(s), InstanceStateName(s),
                                          HumanBytes(i.bytes_moved()),
                                          HumanBytes(i.bytes_total()), note));
  }
  return out;
}

std::string InstanceLabel(const v1::InstanceStatus& status) {
  if (status.adapter_name().empty()) return status.instance_id();
  return absl::StrCat(status.base_instance_id(), " adapter ",
                      status.adapter_name());
}

std::string FormatVersions(const v1::ListVersionsResponse& response) {
  if (response.versions().empty()) return "no versions\n";
  std::string out = absl::StrFormat(
      "%-8s %-11s %10s %11s %10s %9s %7s\n", "VERSION", "STATE", "DURATION",
      "BYTES", "GB/s", "COMMITTED", "ABORTED");
  for (const v1::GetProgressResponse& v : response.versions()) {
    const bool settled =
        v.instances_committed() + v.instances_aborted() == v.instances_total();
    const char* state = !settled                      ? "in progress"
                        : v.instances_aborted() == 0 ? "committed"
                        : v.instances_committed() == 0 ? "aborted"
                                                       : "partial";
    absl::StrAppendFormat(
        &out, "v%-7d %-11s %10s %11s %10.2f %5d/%-3d %7d\n", v.version(), state,
        HumanDuration(v.elapsed_ms()), HumanBytes(v.bytes_moved()),
        v.throughput_bytes_per_second() / 1e9, v.instances_committed(),
        v.instances_total(), v.instances_aborted());
    int64_t patched = 0, wire = 0, changed = 0;
    for (const v1::InstanceProgress& i : v.instances()) {
      patched += i.patched_bytes();
      wire += i.patch_bytes();
      changed += i.changed_bytes();
    }
    const std::string patches = PatchNote(patched, wire, changed);
    if (!patches.empty()) absl::StrAppend(&out, "         ", patches, "\n");
    for (const v1::InstanceProgress& i : v.instances()) {
      if (i.status().state() != v1::INSTANCE_STATE_ABORTED) continue;
      absl::StrAppend(&out, "         ", InstanceLabel(i.status()), " aborted",
                      i.status().dirty() ? " (dirty)" : "", ": ",
                      i.status().abort_reason(), "\n");
    }
  }
  return out;
}

}  // namespace ferry
