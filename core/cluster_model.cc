#include "core/cluster_model.h"

#include <algorithm>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "core/explain.h"
#include "core/geometry.h"
#include "core/region_copy.h"
#include "core/relay_choice.h"
#include "core/validation.h"
#include "nlohmann/json.hpp"

namespace ferry {
namespace {

// The stage of the exchanges' second parts: after every relay stage.
constexpr int kExchangeStage = 1 << 20;

// GPU slots, handed out per node in order of appearance.
class Gpus {
 public:
  int Place(const std::string& node) {
    const int slot = next_[node]++;
    loads_.push_back(GpuLoad{node, slot});
    return static_cast<int>(loads_.size()) - 1;
  }
  GpuLoad& at(int gpu) { return loads_[gpu]; }
  std::vector<GpuLoad>& all() { return loads_; }
  int on_node(const std::string& node) const {
    auto it = next_.find(node);
    return it == next_.end() ? 0 : it->second;
  }

 private:
  std::map<std::string, int> next_;
  std::vector<GpuLoad> loads_;
};

// A distinct box of a parameter.
using Need = std::pair<int32_t, std::vector<int64_t>>;
Need NeedOf(const Piece& p) {
  std::vector<int64_t> key(p.box.offset.begin(), p.box.offset.end());
  key.insert(key.end(), p.box.extent.begin(), p.box.extent.end());
  return {p.param, std::move(key)};
}

// The sender bound (cluster_model.h): trainer nodes joined into groups by
// the shards they share, and the bytes each group must send when every
// engine rank reads its own bytes from trainer ranks.
void SenderBound(const ModelSpec& model, const std::vector<RankLayout>& sources,
                 const std::vector<Instance>& instances,
                 const SourceIndex& index, const Gpus& gpus, double nic,
                 ClusterReport* out) {
  std::map<std::string, int> node_id;
  std::vector<std::string> node_name;
  std::vector<int> rank_node;
  for (const RankLayout& s : sources) {
    auto [it, added] = node_id.emplace(s.node, static_cast<int>(node_name.size()));
    if (added) node_name.push_back(s.node);
    rank_node.push_back(it->second);
  }
  std::vector<int> parent(node_name.size());
  for (size_t n = 0; n < parent.size(); ++n) parent[n] = static_cast<int>(n);
  auto group = [&parent](int n) {
    while (parent[n] != n) n = parent[n] = parent[parent[n]];
    return n;
  };
  for (const std::vector<SourceShard>& shards : index.shards_by_param) {
    for (const SourceShard& shard : shards) {
      const int first = group(rank_node[shard.holders.front().rank_index]);
      for (const PieceRef& h : shard.holders) {
        parent[group(rank_node[h.rank_index])] = first;
      }
    }
  }
  std::vector<int64_t> bytes(node_name.size(), 0);  // by group
  for (const Instance& instance : instances) {
    for (size_t r = 0; r < instance.layout->size(); ++r) {
      auto on = node_id.find(instance.node(r));
      const int dst_node = on == node_id.end() ? -1 : on->second;
      for (const Piece& p : (*instance.layout)[r].pieces) {
        const DType dtype = model.params[p.param].dtype;
        index.ForEachShardOf(p, [&](const SourceShard& shard, Box* part) {
          // A holder on the engine rank's node sends it over NVLink.
          for (const PieceRef& h : shard.holders) {
            if (rank_node[h.rank_index] == dst_node) return;
          }
          bytes[group(rank_node[shard.holders.front().rank_index])] +=
              BoxBytes(part ? *part : p.box, dtype);
        });
      }
    }
  }
  std::vector<int64_t> gpus_of(node_name.size(), 0);  // by group
  for (size_t n = 0; n < node_name.size(); ++n) {
    gpus_of[group(static_cast<int>(n))] += gpus.on_node(node_name[n]);
  }
  for (size_t g = 0; g < node_name.size(); ++g) {
    if (gpus_of[g] == 0) continue;
    const double t = bytes[g] / (nic * gpus_of[g]);
    if (t <= out->sender_bound_s) continue;
    out->sender_bound_s = t;
    out->sender_bound_bytes = bytes[g];
    out->sender_bound_nics = static_cast<int>(gpus_of[g]);
    out->sender_bound_nodes.clear();
    for (size_t n = 0; n < node_name.size(); ++n) {
      if (group(static_cast<int>(n)) == static_cast<int>(g)) {
        out->sender_bound_nodes.push_back(node_name[n]);
      }
    }
  }
}

}  // namespace

absl::StatusOr<ClusterSpec> ParseClusterSpec(const std::string& text) {
  ClusterSpec c;
  for (absl::string_view kv : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::pair<absl::string_view, absl::string_view> p =
        absl::StrSplit(kv, absl::MaxSplits('=', 1));
    double v = 0;
    if (!absl::SimpleAtod(p.second, &v) || v <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--cluster: '", kv, "' must be KEY=POSITIVE_NUMBER"));
    }
    if (p.first == "gpus_per_node") {
      if (v != static_cast<int>(v) || v > 1024) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--cluster: gpus_per_node ", p.second, " must be a whole number "
            "of GPUs (1 to 1024)"));
      }
      c.gpus_per_node = static_cast<int>(v);
    } else if (p.first == "nic_gbits") {
      c.nic_gbits = v;
    } else if (p.first == "nvlink_gbytes") {
      c.nvlink_gbytes = v;
    } else if (p.first == "transfer_workers") {
      if (v != static_cast<int>(v) || v > 256) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--cluster: transfer_workers ", p.second,
            " must be a whole number (1 to 256), as ferryd's flag"));
      }
      c.transfer_workers = static_cast<int>(v);
    } else if (p.first == "rails") {
      if (v != static_cast<int>(v) || v > 1024) {
        return absl::InvalidArgumentError(absl::StrCat(
            "--cluster: rails ", p.second,
            " must be a whole number of NICs (1 to 1024)"));
      }
      c.rails = static_cast<int>(v);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "--cluster: unknown key '", p.first,
          "' (gpus_per_node, nic_gbits, nvlink_gbytes, transfer_workers, "
          "rails)"));
    }
  }
  if (c.rails > c.gpus_per_node) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--cluster: rails ", c.rails, " is more than the ", c.gpus_per_node,
        " NICs of a node (one per GPU)"));
  }
  return c;
}

double PatchFraction(double density) {
  if (density < 0) return 1;
  return std::min(1.0, density + std::min(1.0 / 16, 2 * density));
}

absl::StatusOr<ClusterReport> ModelCluster(
    const ModelSpec& model, const std::vector<RankLayout>& sources,
    const std::vector<Instance>& instances, const Plan& plan,
    const ClusterSpec& cluster, const Plan* direct_plan,
    const SourceIndex* source_index,
    const std::vector<Exchange>* exchanges,
    const std::vector<int>* source_gpu_of) {
  if (plan.instances.size() != instances.size() ||
      (direct_plan != nullptr &&
       direct_plan->instances.size() != instances.size()) ||
      (exchanges != nullptr && exchanges->size() != instances.size())) {
    return absl::InvalidArgumentError("the plan is not of these instances");
  }
  // Whether ferryd runs instance k's relay (core/relay_choice.h), its
  // coordinator on none of these nodes.
  const std::vector<RelayTree> trees = RelayTrees(plan);
  const int source_nodes = SourceNodes(sources);
  auto relays = [&](size_t k) {
    if (plan.instances[k].relay_from < 0) return false;
    return direct_plan == nullptr ||
           WhereRelayRuns(plan, instances, static_cast<int32_t>(k), trees,
                          source_nodes) == RelayWhere::kAlways;
  };
  Gpus gpus;
  std::vector<int> source_gpu;
  for (size_t i = 0; i < sources.size(); ++i) {
    const int shares = source_gpu_of != nullptr && i < source_gpu_of->size()
                           ? (*source_gpu_of)[i]
                           : -1;
    source_gpu.push_back(shares >= 0 && static_cast<size_t>(shares) < i
                             ? source_gpu[shares]
                             : gpus.Place(sources[i].node));
  }
  std::vector<std::vector<int>> engine_gpu(instances.size());
  for (size_t k = 0; k < instances.size(); ++k) {
    for (size_t r = 0; r < instances[k].layout->size(); ++r) {
      engine_gpu[k].push_back(gpus.Place(instances[k].node(r)));
    }
  }
  for (const GpuLoad& g : gpus.all()) {
    if (gpus.on_node(g.node) > cluster.gpus_per_node) {
      return absl::InvalidArgumentError(absl::StrCat(
          "node ", g.node, " hosts ", gpus.on_node(g.node), " ranks but has ",
          cluster.gpus_per_node, " GPUs (--cluster gpus_per_node)"));
    }
  }
  ClusterReport out;
  out.transfer_workers = cluster.transfer_workers;
  out.routes_at_once = cluster.routes_at_once;
  const int rails = cluster.rails > 0
                        ? std::min(cluster.rails, cluster.gpus_per_node)
                        : cluster.gpus_per_node;
  out.rails = rails;
  const double nic = cluster.nic_gbits * 1e9 / 8;
  const double nvlink = cluster.nvlink_gbytes * 1e9;
  const double bucket_s = static_cast<double>(plan.bucket_bytes) / nic;
  // Port loads of a set of transfers that run at once: GPU -> bytes.
  struct Ports {
    std::map<int, int64_t> nic_out, nic_in, nvlink_out, nvlink_in;
  };
  // Delta versions: what crosses between nodes is a patch of it.
  const double patch = PatchFraction(cluster.delta_density);
  auto move = [&](int from, int to, int64_t bytes, Ports* p) {
    if (from == to) return;
    GpuLoad& a = gpus.at(from);
    GpuLoad& b = gpus.at(to);
    if (a.node != b.node) bytes = static_cast<int64_t>(bytes * patch);
    if (a.node == b.node) {
      a.nvlink_out += bytes;
      b.nvlink_in += bytes;
      p->nvlink_out[from] += bytes;
      p->nvlink_in[to] += bytes;
      out.intra_node_bytes += bytes;
    } else {
      a.nic_out += bytes;
      b.nic_in += bytes;
      p->nic_out[from] += bytes;
      p->nic_in[to] += bytes;
      out.cross_node_bytes += bytes;
    }
  };
  // The busiest port of `p`: its time, and a name for it.
  auto busiest = [&](const Ports& p, std::string* what) {
    double worst = 0;
    auto look = [&](const std::map<int, int64_t>& m, double bw, const char* port) {
      for (const auto& [gpu, bytes] : m) {
        if (bytes / bw > worst) {
          worst = bytes / bw;
          if (what != nullptr) {
            *what = absl::StrCat(port, " of ", gpus.at(gpu).node, " GPU ",
                                 gpus.at(gpu).slot);
          }
        }
      }
    };
    look(p.nic_in, nic, "NIC in");
    look(p.nic_out, nic, "NIC out");
    look(p.nvlink_in, nvlink, "NVLink in");
    look(p.nvlink_out, nvlink, "NVLink out");
    return worst;
  };
  // A node's rails: --rails, at most a NIC per GPU it hosts (the NICs the
  // lower bound counts too). A route uses as many as both ends have.
  auto rails_of = [&](const std::string& node) {
    return std::max(1, std::min(rails, gpus.on_node(node)));
  };
  // As ferryd runs it: a node's NIC bytes spread over its rails (each
  // route striped over them), NVLink per GPU.
  auto busiest_striped = [&](const Ports& p) {
    double worst = 0;
    for (auto m : {&Ports::nic_in, &Ports::nic_out}) {
      std::map<std::string, int64_t> by_node;
      for (const auto& [gpu, bytes] : p.*m) by_node[gpus.at(gpu).node] += bytes;
      for (const auto& [node, bytes] : by_node) {
        worst = std::max(worst, bytes / (rails_of(node) * nic));
      }
    }
    Ports nvlink_only;
    nvlink_only.nvlink_in = p.nvlink_in;
    nvlink_only.nvlink_out = p.nvlink_out;
    return std::max(worst, busiest(nvlink_only, nullptr));
  };
  std::map<int, Ports> stages;
  // As ferryd runs it: per stage, its instances in plan order with their
  // own port loads and the time of their routes.
  struct Alone {
    Ports ports;
    double routes_s = 0;
  };
  std::map<int, std::vector<Alone>> by_stage;
  for (size_t k = 0; k < instances.size(); ++k) {
    const bool relay = relays(k);
    const InstancePlan& ip =
        relay || plan.instances[k].relay_from < 0 ? plan.instances[k]
                                                  : direct_plan->instances[k];
    const int stage_of = relay ? ip.stage : 0;
    out.max_stage = std::max(out.max_stage, stage_of);
    Ports alone;
    // Bytes per route (sending node, receiving node).
    std::map<std::pair<std::string, std::string>, int64_t> routes;
    auto route = [&](int from, int to, int64_t bytes) {
      const std::string& a = gpus.at(from).node;
      const std::string& b = gpus.at(to).node;
      routes[{a, b}] += a == b ? bytes : static_cast<int64_t>(bytes * patch);
    };
    const Exchange* exchange =
        !relay && exchanges != nullptr && (*exchanges)[k].partner >= 0
            ? &(*exchanges)[k]
            : nullptr;
    // The second part of an exchange (core/exchange.h): the buckets its
    // partner gives it, rank r from rank r, after every first part.
    Ports given;
    std::map<std::pair<std::string, std::string>, int64_t> given_routes;
    if (!relay) {
      // Bucket by bucket: the first part from the sources, the buckets its
      // partner gives (if any) from the partner.
      for (size_t t = 0; t < ip.buckets.size(); ++t) {
        const Bucket& b = ip.buckets[t];
        const bool is_given =
            exchange != nullptr && exchange->given(static_cast<int32_t>(t));
        for (int32_t i = b.first_copy; i < b.first_copy + b.num_copies; ++i) {
          const Copy& c = ip.copies[i];
          if (!is_given) {
            move(source_gpu[c.src_rank], engine_gpu[k][c.dst_rank], c.bytes,
                 &alone);
            route(source_gpu[c.src_rank], engine_gpu[k][c.dst_rank], c.bytes);
            continue;
          }
          const int from = engine_gpu[exchange->partner][c.dst_rank];
          const int to = engine_gpu[k][c.dst_rank];
          move(from, to, c.bytes, &given);
          given_routes[{gpus.at(from).node, gpus.at(to).node}] += c.bytes;
          out.exchanged_bytes += c.bytes;
        }
      }
    } else {
      // A relay: rank r gets from its relay source's rank r what its
      // class's first instance got from the trainer.
      const int32_t root = RelayRoot(plan, ip.relay_from);
      std::vector<int64_t> per_rank(engine_gpu[k].size(), 0);
      for (const Copy& c : plan.instances[root].copies) per_rank[c.dst_rank] += c.bytes;
      for (size_t r = 0; r < per_rank.size(); ++r) {
        move(engine_gpu[ip.relay_from][r], engine_gpu[k][r], per_rank[r], &alone);
        route(engine_gpu[ip.relay_from][r], engine_gpu[k][r], per_rank[r]);
      }
    }
    // Its routes in waves, each route striped over the rails between
    // nodes, on one GPU's NVLink inside one.
    auto add = [&](int stage_key, const Ports& ports,
                   const std::map<std::pair<std::string, std::string>,
                                  int64_t>& its_routes) {
      Alone mine;
      mine.ports = ports;
      int in_wave = 0;
      double wave = 0;
      for (const auto& [pair, bytes] : its_routes) {
        const double t =
            pair.first == pair.second
                ? bytes / nvlink
                : bytes / (std::min(rails_of(pair.first),
                                    rails_of(pair.second)) * nic);
        wave = std::max(wave, t);
        if (++in_wave == std::max(1, cluster.routes_at_once)) {
          mine.routes_s += wave;
          in_wave = 0;
          wave = 0;
        }
      }
      mine.routes_s += wave;
      by_stage[stage_key].push_back(std::move(mine));
      Ports& stage = stages[stage_key];
      for (auto m : {&Ports::nic_out, &Ports::nic_in, &Ports::nvlink_out,
                     &Ports::nvlink_in}) {
        for (const auto& [gpu, bytes] : ports.*m) (stage.*m)[gpu] += bytes;
      }
    };
    add(stage_of, alone, routes);
    if (exchange != nullptr) add(kExchangeStage, given, given_routes);
  }
  // As ferryd runs it: waves of transfer_workers instances per stage.
  for (const auto& [stage, list] : by_stage) {
    const size_t workers =
        static_cast<size_t>(std::max(1, cluster.transfer_workers));
    for (size_t first = 0; first < list.size(); first += workers) {
      Ports wave;
      double routes_s = 0;
      for (size_t i = first; i < std::min(list.size(), first + workers); ++i) {
        for (auto m : {&Ports::nic_out, &Ports::nic_in, &Ports::nvlink_out,
                       &Ports::nvlink_in}) {
          for (const auto& [gpu, bytes] : list[i].ports.*m) {
            (wave.*m)[gpu] += bytes;
          }
        }
        routes_s = std::max(routes_s, list[i].routes_s);
      }
      out.ferryd_s += std::max(busiest_striped(wave), routes_s) + bucket_s;
    }
  }
  for (const auto& [stage, ports] : stages) {
    std::string what;
    const double t = busiest(ports, &what);
    out.stage_s.push_back(t + bucket_s);
    out.modeled_s += t + bucket_s;
    out.pipeline_s += bucket_s;
    if (t > out.busiest_s) {
      out.busiest_s = t;
      out.busiest = stage == kExchangeStage
                        ? absl::StrCat(what, " in the exchanges' second part")
                        : absl::StrCat(what, " in relay stage ", stage);
    }
  }

  // The lower bound: per node, the distinct boxes its engine ranks need
  // that its trainer ranks do not hold, over its NICs.
  std::map<std::string, std::set<Need>> needed, held;
  std::map<std::string, std::map<int32_t, std::vector<Box>>> held_boxes;
  for (const RankLayout& s : sources) {
    for (const Piece& p : s.pieces) {
      if (held[s.node].insert(NeedOf(p)).second) {
        held_boxes[s.node][p.param].push_back(p.box);
      }
    }
  }
  for (size_t k = 0; k < instances.size(); ++k) {
    for (size_t r = 0; r < instances[k].layout->size(); ++r) {
      for (const Piece& p : (*instances[k].layout)[r].pieces) {
        needed[instances[k].node(r)].insert(NeedOf(p));
      }
    }
  }
  for (const auto& [node, needs] : needed) {
    int64_t bytes = 0;
    auto hb = held_boxes.find(node);
    for (const Need& n : needs) {
      Box box;
      const size_t dims = n.second.size() / 2;
      box.offset.assign(n.second.begin(), n.second.begin() + dims);
      box.extent.assign(n.second.begin() + dims, n.second.end());
      const DType dtype = model.params[n.first].dtype;
      int64_t b = BoxBytes(box, dtype);
      if (hb != held_boxes.end()) {
        auto boxes = hb->second.find(n.first);
        if (boxes != hb->second.end()) {
          for (const Box& h : boxes->second) {
            if (auto i = Intersect(box, h)) b -= BoxBytes(*i, dtype);
          }
        }
      }
      bytes += std::max<int64_t>(b, 0);
    }
    const double s = bytes * patch / (nic * gpus.on_node(node));
    if (s > out.lower_bound_s) {
      out.lower_bound_s = s;
      out.bound_node = node;
      out.bound_bytes = bytes;
    }
  }
  out.ratio = out.lower_bound_s > 0 ? out.modeled_s / out.lower_bound_s : 0;
  absl::StatusOr<SourceIndex> own_index;
  if (source_index == nullptr) {
    own_index = ValidateSources(model, sources);
    if (!own_index.ok()) return own_index.status();
    source_index = &*own_index;
  }
  SenderBound(model, sources, instances, *source_index, gpus, nic, &out);
  out.gpus = std::move(gpus.all());
  std::sort(out.gpus.begin(), out.gpus.end(), [](const GpuLoad& a, const GpuLoad& b) {
    return std::tie(a.node, a.slot) < std::tie(b.node, b.slot);
  });
  out.sender_bound_s *= patch;
  out.assumptions = {
      absl::StrFormat("%d GPUs per node; per GPU a NIC of %.0f Gb/s and "
                      "NVLink of %.0f GB/s, each direction",
                      cluster.gpus_per_node, cluster.nic_gbits,
                      cluster.nvlink_gbytes),
      "every port streams at its full rate at once (no congestion inside "
      "the network, no protocol overhead)",
      "the instances of a relay stage move at once; a stage begins when "
      "the one before it ended (a replica relays once its source holds the "
      "version); each stage fills its pipe with one bucket over a NIC",
      "the exchanges' second parts (replicas passing each other buckets, "
      "core/exchange.h) move at once, after every relay stage, as one "
      "stage more",
      "each rank is a GPU of its own; distinct boxes a node needs are "
      "counted once (boxes that overlap in part, each)",
      absl::StrFormat(
          "as ferryd runs it: %d instances of a stage at once, %d routes "
          "of an instance at once, each route between two nodes striped "
          "over %d rails (NICs) of each, which a node's routes share",
          cluster.transfer_workers, cluster.routes_at_once, rails)};
  if (cluster.delta_density >= 0) {
    out.assumptions.push_back(absl::StrFormat(
        "delta versions: %.2f%% of the elements change, so what crosses "
        "between nodes (and both bounds) is a patch of %.1f%% of the bytes "
        "(copies inside a node are whole)",
        cluster.delta_density * 100, patch * 100));
  }
  return out;
}

std::string FormatClusterReport(const ClusterReport& r) {
  std::vector<std::string> stages;
  for (double s : r.stage_s) stages.push_back(absl::StrFormat("%.3f", s));
  std::string out = "cluster model of one version:\n";
  for (const std::string& a : r.assumptions) {
    absl::StrAppend(&out, "  assume ", a, "\n");
  }
  absl::StrAppendFormat(
      &out,
      "  bytes: %s between nodes, %s inside them (NVLink); %s of them "
      "exchanged between replicas\n"
      "  busiest port: %s, %.3f s\n"
      "  pipeline fill: %.3f s in all (%d relay hops)\n"
      "  modeled: %.3f s (stages: %s)\n"
      "  as ferryd runs it (%d instances at once, %d routes of an instance "
      "at once, a route striped over %d rails): %.3f s\n"
      "  lower bound: %.3f s (%s must receive %s over its NICs)\n"
      "  modeled / lower bound: %.2fx\n"
      "  without forwarding (every engine rank reads its own bytes from "
      "trainer ranks) no plan beats %.3f s: %s %s %s that engine ranks on "
      "other nodes need, over %d NICs\n",
      HumanBytes(r.cross_node_bytes), HumanBytes(r.intra_node_bytes),
      HumanBytes(r.exchanged_bytes), r.busiest.empty() ? "none" : r.busiest,
      r.busiest_s, r.pipeline_s,
      r.max_stage, r.modeled_s, absl::StrJoin(stages, " + "),
      r.transfer_workers, r.routes_at_once, r.rails, r.ferryd_s,
      r.lower_bound_s,
      r.bound_node.empty() ? "no node" : r.bound_node, HumanBytes(r.bound_bytes),
      r.ratio, r.sender_bound_s,
      r.sender_bound_nodes.empty() ? "no trainer node"
                                   : absl::StrJoin(r.sender_bound_nodes, ", "),
      r.sender_bound_nodes.size() == 1 ? "must send" : "together must send",
      HumanBytes(r.sender_bound_bytes), r.sender_bound_nics);
  return out;
}

std::string ClusterReportJson(const ClusterReport& r) {
  nlohmann::json j;
  j["modeled_s"] = r.modeled_s;
  j["busiest_port"] = r.busiest;
  j["busiest_s"] = r.busiest_s;
  j["pipeline_s"] = r.pipeline_s;
  j["lower_bound_s"] = r.lower_bound_s;
  j["bound_node"] = r.bound_node;
  j["bound_bytes"] = r.bound_bytes;
  j["ratio"] = r.ratio;
  j["sender_bound_s"] = r.sender_bound_s;
  j["sender_bound_nodes"] = r.sender_bound_nodes;
  j["sender_bound_bytes"] = r.sender_bound_bytes;
  j["sender_bound_nics"] = r.sender_bound_nics;
  j["relay_hops"] = r.max_stage;
  j["stage_s"] = r.stage_s;
  j["ferryd_s"] = r.ferryd_s;
  j["transfer_workers"] = r.transfer_workers;
  j["routes_at_once"] = r.routes_at_once;
  j["rails"] = r.rails;
  j["cross_node_bytes"] = r.cross_node_bytes;
  j["intra_node_bytes"] = r.intra_node_bytes;
  j["exchanged_bytes"] = r.exchanged_bytes;
  j["assumptions"] = r.assumptions;
  j["gpus"] = nlohmann::json::array();
  for (const GpuLoad& g : r.gpus) {
    j["gpus"].push_back({{"node", g.node}, {"gpu", g.slot}, {"nic_in", g.nic_in},
                         {"nic_out", g.nic_out}, {"nvlink_in", g.nvlink_in},
                         {"nvlink_out", g.nvlink_out}});
  }
  return j.dump(2);
}

}  // namespace ferry
