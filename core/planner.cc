#include "core/planner.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <unordered_map>

#include "absl/strings/str_cat.h"
#include "core/parallel_for.h"
#include "core/region_copy.h"

namespace ferry {
namespace {

// Small integer ids for node names, so holder selection compares ints.
// The planner names the sources' nodes first, so theirs are the lowest.
class NodeIds {
 public:
  int32_t Get(const std::string& node) {
    auto it = ids_.find(node);
    if (it != ids_.end()) return it->second;
    const int32_t id = static_cast<int32_t>(ids_.size());
    ids_.emplace(node, id);
    return id;
  }

 private:
  std::unordered_map<std::string, int32_t> ids_;
};

// Picks which replica of a shard serves a destination on `dst_node`: one
// on that node, else the one with the least `load`.
const PieceRef& ChooseHolder(const SourceShard& shard, int32_t dst_node,
                             const std::vector<int32_t>& source_node,
                             const std::vector<int64_t>& load) {
  const PieceRef* best = &shard.holders.front();
  for (const PieceRef& h : shard.holders) {
    const bool h_local = source_node[h.rank_index] == dst_node;
    const bool b_local = source_node[best->rank_index] == dst_node;
    if (h_local != b_local) {
      if (h_local) best = &h;
      continue;
    }
    if (load[h.rank_index] < load[best->rank_index]) best = &h;
  }
  return *best;
}

// A hash of a destination layout, to find layouts equal to an earlier one
// without comparing every piece: each rank hashed on the planning threads,
// the ranks' hashes combined in order.
uint64_t LayoutDigest(const std::vector<RankLayout>& ranks) {
  auto mix = [](uint64_t h, int64_t v) {
    h ^= static_cast<uint64_t>(v);
    h *= 0x100000001b3ull;
    return h ^ (h >> 29);
  };
  std::vector<uint64_t> by_rank(ranks.size());
  ParallelFor(ranks.size(), PlanningThreads(), [&](size_t r) {
    uint64_t h = 0xcbf29ce484222325ull;
    h = mix(h, ranks[r].rank);
    h = mix(h, static_cast<int64_t>(ranks[r].pieces.size()));
    for (const Piece& p : ranks[r].pieces) {
      h = mix(h, p.param);
      h = mix(h, p.buffer);
      h = mix(h, p.byte_offset);
      for (size_t i = 0; i < p.box.rank(); ++i) {
        h = mix(h, p.box.offset[i]);
        h = mix(h, p.box.extent[i]);
        h = mix(h, p.strides[i]);
      }
    }
    by_rank[r] = h;
  });
  uint64_t h = 0xcbf29ce484222325ull;
  for (uint64_t r : by_rank) h = mix(h, static_cast<int64_t>(r));
  return h;
}

bool SameLayout(const std::vector<RankLayout>& a,
                const std::vector<RankLayout>& b) {
  if (a.size() != b.size()) return false;
  for (size_t r = 0; r < a.size(); ++r) {
    if (a[r].rank != b[r].rank || a[r].pieces.size() != b[r].pieces.size()) {
      return false;
    }
    for (size_t i = 0; i < a[r].pieces.size(); ++i) {
      const Piece& x = a[r].pieces[i];
      const Piece& y = b[r].pieces[i];
      if (x.param != y.param || x.box != y.box || x.buffer != y.buffer ||
          x.byte_offset != y.byte_offset || x.strides != y.strides) {
        return false;
      }
    }
  }
  return true;
}

// Node of each destination rank of `instance`, as an id from `node_ids`,
// and the first rank on each rank's node.
struct DestinationNodes {
  std::vector<int32_t> node;        // by rank
  std::vector<int32_t> first_rank;  // by rank: lowest rank on its node
};

DestinationNodes NodesOf(const Instance& instance, NodeIds& node_ids) {
  DestinationNodes out;
  const size_t n = instance.layout->size();
  std::unordered_map<int32_t, int32_t> first;
  for (size_t d = 0; d < n; ++d) {
    const int32_t id = node_ids.Get(instance.node(d));
    out.node.push_back(id);
    out.first_rank.push_back(
        first.emplace(id, static_cast<int32_t>(d)).first->second);
  }
  return out;
}

// Walks every (piece, source shard) pair of destination rank `rank` that
// share elements (SourceIndex::ForEachShardOf), in the order the copies
// are made: piece by piece, shard by shard, passing over the parameters
// for which `skip(param)` holds. `visit(i, shard, part)` gets the part of
// piece i that the shard holds, or null when it holds the whole piece.
// One walk for both ChooseHolders and PlanFromSources keeps their orders
// the same.
template <typename Skip, typename Visit>
void ForEachOverlap(const SourceIndex& index, const RankLayout& rank,
                    const Skip& skip, const Visit& visit) {
  const std::vector<Piece>& pieces = rank.pieces;
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (skip(pieces[i].param)) continue;
    index.ForEachShardOf(pieces[i], [&](const SourceShard& shard, Box* part) {
      visit(i, shard, part);
    });
  }
}

// The holder of every (piece, shard) pair of a layout whose shard has
// several holders, in the order ForEachOverlap meets them, rank by rank:
// rank d's are holder[rank_start[d]] up to holder[rank_start[d + 1]].
struct ChosenHolders {
  std::vector<const PieceRef*> holder;
  std::vector<size_t> rank_start;
};

// They are chosen largest first (the longest-processing-time rule), each
// going to the least loaded holder given `balance` (seeded with the bytes
// of the shards only one rank holds). Chosen in the layout's order
// instead, a large shard could land on a holder that smaller ones had
// already filled, and every replica that shares the copies repeated that
// unevenness (docs/benchmarks.md, "Holders chosen largest first").
ChosenHolders ChooseHolders(const ModelSpec& model, const SourceIndex& index,
                            const std::vector<RankLayout>& ranks,
                            const DestinationNodes& dst_nodes,
                            const std::vector<int32_t>& source_node,
                            std::vector<int64_t> balance) {
  struct Need {
    int64_t bytes;
    const SourceShard* shard;
    int32_t dst_node;
  };
  // Per rank on the planning threads (the walk reads every piece), then
  // in rank order.
  std::vector<std::vector<Need>> by_rank(ranks.size());
  ParallelFor(ranks.size(), PlanningThreads(), [&](size_t d) {
    ForEachOverlap(
        index, ranks[d],
        [&index](int32_t param) { return !index.replicated[param]; },
        [&](size_t i, const SourceShard& shard, const Box* part) {
          if (shard.holders.size() < 2) return;
          const Piece& dst = ranks[d].pieces[i];
          by_rank[d].push_back(Need{
              BoxBytes(part ? *part : dst.box, model.params[dst.param].dtype),
              &shard, dst_nodes.node[d]});
        });
  });
  ChosenHolders out;
  std::vector<Need> needs;
  for (const std::vector<Need>& r : by_rank) {
    out.rank_start.push_back(needs.size());
    needs.insert(needs.end(), r.begin(), r.end());
  }
  out.rank_start.push_back(needs.size());
  std::vector<int32_t> order(needs.size());
  for (size_t n = 0; n < order.size(); ++n) order[n] = static_cast<int32_t>(n);
  std::stable_sort(order.begin(), order.end(), [&needs](int32_t a, int32_t b) {
    return needs[a].bytes > needs[b].bytes;
  });
  out.holder.resize(needs.size());
  for (int32_t n : order) {
    const Need& need = needs[n];
    const PieceRef& h =
        ChooseHolder(*need.shard, need.dst_node, source_node, balance);
    balance[h.rank_index] += need.bytes;
    out.holder[n] = &h;
  }
  return out;
}

// One destination rank's copies from the sources, before routes group
// them. Every copy of a rank ends on the rank's node, so its route is
// known from its holder's node alone.
struct RankCopies {
  std::vector<Copy> copies;  // `box`: an index into `boxes`
  std::vector<Box> boxes;
  std::vector<int32_t> src_node;  // by copy: its holder's node id
  std::vector<int32_t> per_node;  // copies by source node id
  std::vector<int64_t> load;      // bytes sent, by source rank
  int64_t bytes = 0;
};

// The copies of destination rank `d` of `ranks`, each piece from the
// shards that overlap it, the holders of several-holder shards as
// `chosen` says, each copy split to fit a bucket.
void PlanRank(const ModelSpec& model, const SourceIndex& index,
              const std::vector<RankLayout>& ranks, size_t d,
              const std::vector<int32_t>& source_node, int32_t num_nodes,
              const ChosenHolders& chosen, int64_t bucket_bytes,
              RankCopies* out) {
  const std::vector<Piece>& pieces = ranks[d].pieces;
  // Most pieces take one copy; a few (reshards) take more.
  out->copies.reserve(pieces.size() + pieces.size() / 4);
  out->src_node.reserve(pieces.size() + pieces.size() / 4);
  out->per_node.assign(num_nodes, 0);
  out->load.assign(source_node.size(), 0);
  size_t next_chosen = chosen.rank_start[d];
  std::vector<Box> split;
  // `box`: the part of the piece moved, or null for the whole piece.
  auto add_copy = [&](int32_t param, const PieceRef& holder, int32_t i,
                      Box* box, int64_t bytes) {
    Copy c;
    if (box != nullptr && *box != pieces[i].box) {
      c.box = static_cast<int32_t>(out->boxes.size());
      out->boxes.push_back(std::move(*box));
    }
    c.param = param;
    c.src_rank = holder.rank_index;
    c.src_piece = holder.piece_index;
    c.dst_rank = static_cast<int32_t>(d);
    c.dst_piece = i;
    c.bytes = bytes;
    out->load[holder.rank_index] += bytes;
    out->bytes += bytes;
    out->copies.push_back(c);
    const int32_t node = source_node[holder.rank_index];
    out->src_node.push_back(node);
    ++out->per_node[node];
  };
  ForEachOverlap(
      index, ranks[d], [](int32_t) { return false; },
      [&](size_t i, const SourceShard& shard, Box* part) {
        const Piece& dst = pieces[i];
        const PieceRef& holder = shard.holders.size() == 1
                                     ? shard.holders.front()
                                     : *chosen.holder[next_chosen++];
        const DType dtype = model.params[dst.param].dtype;
        const Box& box = part ? *part : dst.box;
        const int64_t bytes = BoxBytes(box, dtype);
        const int32_t piece = static_cast<int32_t>(i);
        if (bytes <= bucket_bytes) {  // the common case: no split
          add_copy(dst.param, holder, piece, part, bytes);
          return;
        }
        split.clear();
        SplitBox(box, dtype, bucket_bytes, &split);
        for (Box& piece_part : split) {
          const int64_t part_bytes = BoxBytes(piece_part, dtype);
          add_copy(dst.param, holder, piece, &piece_part, part_bytes);
        }
      });
}

// Plans the copies of one instance from the trainer ranks, adding the
// bytes each sends to `load` (by source rank). Holders are chosen by the
// instance's own load, seeded with `fixed` (by source rank: the bytes of
// shards it alone holds, which every complete instance reads from it), so
// that a shard with several holders goes to the one with less to send in
// all, not merely so far, largest first (ChooseHolders). The copies then
// depend only on the layout and on which of its ranks share a node with
// each other and with sources; routes are ordered by source node name,
// then by the first destination rank of their node, not by its name.
// Replicas that agree on those (SourcePlanner::ReadAlike) get the same
// copies in the same order, and share them.
//
// Each rank's copies are made on the planning threads (PlanRank), then
// placed route by route, rank by rank within a route, each rank writing
// its own slots: the same copies in the same order as one thread would
// make them.
void PlanFromSources(const ModelSpec& model,
                     const std::vector<RankLayout>& sources,
                     const SourceIndex& index, const Instance& instance,
                     const std::vector<int32_t>& source_node,
                     NodeIds& node_ids, const PlanOptions& options,
                     const std::vector<int64_t>& fixed,
                     std::vector<int64_t>& load, InstancePlan* out) {
  const std::vector<RankLayout>& ranks = *instance.layout;
  const DestinationNodes dst_nodes = NodesOf(instance, node_ids);
  const ChosenHolders chosen =
      ChooseHolders(model, index, ranks, dst_nodes, source_node, fixed);
  // Every copy's source node id is below this: the number of source
  // nodes, since theirs were the first ids taken.
  int32_t num_nodes = 0;
  for (int32_t n : source_node) num_nodes = std::max(num_nodes, n + 1);
  std::vector<RankCopies> by_rank(ranks.size());
  ParallelFor(ranks.size(), PlanningThreads(), [&](size_t d) {
    PlanRank(model, index, ranks, d, source_node, num_nodes, chosen,
             options.bucket_bytes, &by_rank[d]);
  });
  // Routes, one per (source node, destination node) pair that copies
  // take, in a deterministic order that replicas share: by source node
  // name, then by the first destination rank on the destination node.
  std::vector<const std::string*> node_name(num_nodes, nullptr);
  for (size_t r = 0; r < sources.size(); ++r) {
    node_name[source_node[r]] = &sources[r].node;
  }
  std::map<std::pair<int32_t, int32_t>, int32_t> route_of;  // nodes -> id
  std::vector<Route> routes;
  std::vector<int32_t> route_rank;
  // rank_route[d][s]: the route of rank d's copies from source node s, or
  // -1 when it has none; every rank of a node shares that node's routes.
  std::vector<std::vector<int32_t>> rank_route(ranks.size());
  for (size_t d = 0; d < ranks.size(); ++d) {
    rank_route[d].assign(num_nodes, -1);
    for (int32_t s = 0; s < num_nodes; ++s) {
      if (by_rank[d].per_node[s] == 0) continue;
      auto [it, added] = route_of.emplace(
          std::make_pair(s, dst_nodes.node[d]),
          static_cast<int32_t>(routes.size()));
      rank_route[d][s] = it->second;
      if (!added) continue;
      Route route;
      route.src_node = *node_name[s];
      route.dst_node = instance.node(d);
      routes.push_back(std::move(route));
      route_rank.push_back(dst_nodes.first_rank[d]);
    }
  }
  const size_t num_routes = routes.size();
  std::vector<int32_t> order(num_routes);
  for (size_t c = 0; c < order.size(); ++c) order[c] = static_cast<int32_t>(c);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return std::tie(routes[a].src_node, route_rank[a]) <
           std::tie(routes[b].src_node, route_rank[b]);
  });
  std::vector<int32_t> position(num_routes);  // route id -> its place
  for (size_t k = 0; k < order.size(); ++k) position[order[k]] = k;
  // A counting sort: where each route's copies start, then where each
  // rank's copies from each source node go (rank_cursor[d][s]), ranks in
  // order within a route.
  std::vector<int32_t> start(num_routes + 1, 0);
  for (size_t d = 0; d < ranks.size(); ++d) {
    for (int32_t s = 0; s < num_nodes; ++s) {
      if (rank_route[d][s] >= 0) {
        start[position[rank_route[d][s]] + 1] += by_rank[d].per_node[s];
      }
    }
  }
  for (size_t k = 1; k < start.size(); ++k) start[k] += start[k - 1];
  std::vector<int32_t> cursor(start.begin(), start.end() - 1);
  std::vector<std::vector<int32_t>> rank_cursor(ranks.size());
  std::vector<int32_t> box_start(ranks.size() + 1, 0);
  for (size_t d = 0; d < ranks.size(); ++d) {
    rank_cursor[d].assign(num_nodes, 0);
    for (int32_t s = 0; s < num_nodes; ++s) {
      if (rank_route[d][s] < 0) continue;
      int32_t& c = cursor[position[rank_route[d][s]]];
      rank_cursor[d][s] = c;
      c += by_rank[d].per_node[s];
    }
    box_start[d + 1] =
        box_start[d] + static_cast<int32_t>(by_rank[d].boxes.size());
  }
  for (const RankCopies& rc : by_rank) {
    out->bytes += rc.bytes;
    for (size_t r = 0; r < load.size(); ++r) load[r] += rc.load[r];
  }
  std::vector<Copy> copies(start.back());
  std::vector<Box> boxes(box_start.back());
  ParallelFor(ranks.size(), PlanningThreads(), [&](size_t d) {
    RankCopies& rc = by_rank[d];
    std::vector<int32_t>& next = rank_cursor[d];
    for (size_t k = 0; k < rc.copies.size(); ++k) {
      Copy c = rc.copies[k];
      if (c.box != Copy::kWholePiece) c.box += box_start[d];
      copies[next[rc.src_node[k]]++] = c;
    }
    std::move(rc.boxes.begin(), rc.boxes.end(), boxes.begin() + box_start[d]);
    rc = RankCopies();  // frees this rank's copies on its thread
  });
  for (size_t k = 0; k < num_routes; ++k) {
    out->routes.push_back(std::move(routes[order[k]]));
  }
  // Buckets: consecutive copies of a route up to bucket_bytes.
  std::vector<Bucket> buckets;
  for (size_t ch = 0; ch < out->routes.size(); ++ch) {
    Bucket bucket;
    bucket.route = static_cast<int32_t>(ch);
    bucket.first_copy = start[ch];
    for (int32_t k = start[ch]; k < start[ch + 1]; ++k) {
      const int64_t bytes = copies[k].bytes;
      if (bucket.num_copies > 0 && bucket.bytes + bytes > options.bucket_bytes) {
        out->routes[ch].bytes += bucket.bytes;
        buckets.push_back(bucket);
        bucket.first_copy = k;
        bucket.num_copies = 0;
        bucket.bytes = 0;
      }
      bucket.bytes += bytes;
      ++bucket.num_copies;
    }
    if (bucket.num_copies > 0) {
      out->routes[ch].bytes += bucket.bytes;
      buckets.push_back(bucket);
    }
  }
  out->copies = SharedVector<Copy>(std::move(copies));
  out->boxes = SharedVector<Box>(std::move(boxes));
  out->buckets = SharedVector<Bucket>(std::move(buckets));
}

// Bytes each rank of `layout` receives: the same for every replica of a
// layout class, so computed once per class, not once per relayed replica
// (7 x 1.1M pieces for Kimi-K2's 8 replicas at TP 16).
std::vector<int64_t> BytesPerRank(const ModelSpec& model,
                                  const std::vector<RankLayout>& layout) {
  std::vector<int64_t> bytes(layout.size(), 0);
  ParallelFor(layout.size(), PlanningThreads(), [&](size_t r) {
    int64_t sum = 0;  // not bytes[r]: threads would share its cache line
    for (const Piece& p : layout[r].pieces) {
      sum += BoxBytes(p.box, model.params[p.param].dtype);
    }
    bytes[r] = sum;
  });
  return bytes;
}

// A relayed instance receives rank r's pieces from rank r of `from`.
void PlanRelay(const std::vector<int64_t>& rank_bytes, const Instance& from,
               const Instance& to, InstancePlan* out) {
  std::map<std::pair<std::string, std::string>, int64_t> route_bytes;
  for (size_t r = 0; r < rank_bytes.size(); ++r) {
    route_bytes[{from.node(r), to.node(r)}] += rank_bytes[r];
    out->bytes += rank_bytes[r];
  }
  for (const auto& [nodes, bytes] : route_bytes) {
    out->routes.push_back(Route{nodes.first, nodes.second, bytes});
  }
}

}  // namespace

void SplitBox(const Box& box, DType dtype, int64_t max_bytes,
              std::vector<Box>* out) {
  const int64_t total = BoxBytes(box, dtype);
  if (total <= max_bytes || total == 0) {
    out->push_back(box);
    return;
  }
  const Box units = StorageBox(box, dtype);
  const size_t n = units.rank();
  size_t d = 0;
  while (d < n && units.extent[d] == 1) ++d;
  if (d == n) {  // one unit larger than a bucket: cannot split further
    out->push_back(box);
    return;
  }
  const int64_t block = (d + 1 == n) ? BlockElems(dtype) : 1;
  const int64_t step_bytes = total / units.extent[d];
  if (step_bytes <= max_bytes) {
    const int64_t per_chunk = std::max<int64_t>(1, max_bytes / step_bytes);
    for (int64_t k = 0; k < units.extent[d]; k += per_chunk) {
      Box part = box;
      part.offset[d] = box.offset[d] + k * block;
      part.extent[d] = std::min(per_chunk, units.extent[d] - k) * block;
      out->push_back(std::move(part));
    }
    return;
  }
  for (int64_t k = 0; k < units.extent[d]; ++k) {
    Box part = box;
    part.offset[d] = box.offset[d] + k * block;
    part.extent[d] = block;
    SplitBox(part, dtype, max_bytes, out);
  }
}

absl::StatusOr<std::unique_ptr<const SourcePlanner>> SourcePlanner::Create(
    const ModelSpec& model, const std::vector<RankLayout>& sources,
    const PlanOptions& options) {
  if (options.bucket_bytes <= 0) {
    return absl::InvalidArgumentError("bucket_bytes must be positive");
  }
  absl::Status s = ValidateModelSpec(model);
  if (!s.ok()) return s;
  absl::StatusOr<SourceIndex> index = ValidateSources(model, sources);
  if (!index.ok()) return index.status();
  auto planner = std::unique_ptr<SourcePlanner>(
      new SourcePlanner(model, sources, options, *std::move(index)));
  planner->fixed_load_.assign(sources.size(), 0);
  const auto& shards_by_param = planner->index_.shards_by_param;
  for (size_t p = 0; p < shards_by_param.size(); ++p) {
    for (const SourceShard& shard : shards_by_param[p]) {
      if (shard.holders.size() != 1) continue;
      planner->fixed_load_[shard.holders.front().rank_index] +=
          BoxBytes(shard.box, model.params[p].dtype);
    }
  }
  for (const RankLayout& r : sources) {
    planner->source_node_id_.emplace(
        r.node, static_cast<int32_t>(planner->source_node_id_.size()));
  }
  return std::unique_ptr<const SourcePlanner>(std::move(planner));
}

std::vector<int64_t> SourcePlanner::Signature(const Instance& instance) const {
  std::unordered_map<std::string, int32_t> first_rank;
  std::vector<int64_t> out;
  out.reserve(instance.layout->size());
  for (size_t d = 0; d < instance.layout->size(); ++d) {
    const std::string& node = instance.node(d);
    auto source = source_node_id_.find(node);
    if (source != source_node_id_.end()) {
      out.push_back(-1 - int64_t{source->second});
      continue;
    }
    out.push_back(
        first_rank.emplace(node, static_cast<int32_t>(d)).first->second);
  }
  return out;
}

bool SourcePlanner::ReadAlike(const Instance& a, const Instance& b) const {
  if (a.layout != b.layout && !SameLayout(*a.layout, *b.layout)) return false;
  return Signature(a) == Signature(b);
}

InstancePlan SourcePlanner::PlanFromSourcesOf(
    const Plan& plan, const std::vector<Instance>& instances,
    int32_t k) const {
  if (plan.instances[k].relay_from < 0) return plan.instances[k];
  const int32_t root = RelayRoot(plan, k);
  return ReadAlike(instances[root], instances[k])
             ? PlanAlike(plan.instances[root], instances[k])
             : PlanAlone(instances[k]);
}

InstancePlan SourcePlanner::PlanAlike(const InstancePlan& like,
                                      const Instance& instance) const {
  InstancePlan ip;
  ip.instance = instance.id;
  ip.layout_class = like.layout_class;
  ip.copies = like.copies;
  ip.boxes = like.boxes;
  ip.buckets = like.buckets;
  ip.bytes = like.bytes;
  ip.routes = like.routes;
  // Each route's destination node is that of any rank it ends on: the
  // first copy of its first bucket tells one.
  std::vector<bool> named(ip.routes.size(), false);
  for (const Bucket& b : ip.buckets) {
    if (named[b.route]) continue;
    named[b.route] = true;
    ip.routes[b.route].dst_node =
        instance.node(ip.copies[b.first_copy].dst_rank);
  }
  return ip;
}

InstancePlan SourcePlanner::PlanAlone(const Instance& instance) const {
  NodeIds node_ids;
  std::vector<int32_t> source_node(sources_.size());
  for (size_t r = 0; r < sources_.size(); ++r) {
    source_node[r] = node_ids.Get(sources_[r].node);
  }
  std::vector<int64_t> load(sources_.size(), 0);
  InstancePlan ip;
  ip.instance = instance.id;
  PlanFromSources(model_, sources_, index_, instance, source_node, node_ids,
                  options_, fixed_load_, load, &ip);
  return ip;
}

absl::StatusOr<Plan> PlanTransfers(const ModelSpec& model,
                                   const std::vector<RankLayout>& sources,
                                   const std::vector<Instance>& instances,
                                   const PlanOptions& options) {
  absl::StatusOr<std::unique_ptr<const SourcePlanner>> planner =
      SourcePlanner::Create(model, sources, options);
  if (!planner.ok()) return planner.status();
  return (*planner)->PlanInstances(instances);
}

absl::StatusOr<Plan> SourcePlanner::PlanInstances(
    const std::vector<Instance>& instances) const {
  const ModelSpec& model = model_;
  const std::vector<RankLayout>& sources = sources_;
  const PlanOptions& options = options_;
  absl::Status s;
  // Layout classes: replicas share a layout object, or an equal one.
  struct LayoutClass {
    const std::vector<RankLayout>* layout;
    uint64_t digest;
    std::vector<int32_t> members;  // instance indices, in input order
  };
  std::vector<LayoutClass> classes;
  std::vector<int32_t> class_of(instances.size());
  std::unordered_map<const void*, int32_t> class_by_pointer;
  std::set<std::string> ids;
  for (size_t k = 0; k < instances.size(); ++k) {
    const Instance& inst = instances[k];
    if (!inst.layout) {
      return absl::InvalidArgumentError(
          absl::StrCat("instance ", inst.id, " has no layout"));
    }
    if (!ids.insert(inst.id).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("instance ", inst.id, " is listed twice"));
    }
    if (!inst.nodes.empty() && inst.nodes.size() != inst.layout->size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "instance ", inst.id, " names ", inst.nodes.size(), " nodes for ",
          inst.layout->size(), " ranks"));
    }
    auto known = class_by_pointer.find(inst.layout.get());
    if (known != class_by_pointer.end()) {
      class_of[k] = known->second;
      classes[known->second].members.push_back(k);
      continue;
    }
    if (!options.destinations_validated) {
      s = ValidateDestination(model, *inst.layout, inst.id);
      if (!s.ok()) return s;
    }
    const uint64_t digest = LayoutDigest(*inst.layout);
    int32_t found = -1;
    for (size_t c = 0; c < classes.size(); ++c) {
      if (classes[c].digest == digest &&
          SameLayout(*classes[c].layout, *inst.layout)) {
        found = static_cast<int32_t>(c);
        break;
      }
    }
    if (found < 0) {
      found = static_cast<int32_t>(classes.size());
      classes.push_back(LayoutClass{inst.layout.get(), digest, {}});
    }
    class_by_pointer.emplace(inst.layout.get(), found);
    class_of[k] = found;
    classes[found].members.push_back(k);
  }

  NodeIds node_ids;
  std::vector<int32_t> source_node(sources.size());
  for (size_t r = 0; r < sources.size(); ++r) {
    source_node[r] = node_ids.Get(sources[r].node);
  }

  Plan plan;
  plan.bucket_bytes = options.bucket_bytes;
  plan.bytes_per_source_rank.assign(sources.size(), 0);
  plan.instances.resize(instances.size());
  std::vector<std::vector<int64_t>> class_rank_bytes(classes.size());
  // Instances planned from the sources: their signatures and bytes per
  // source rank, for the replicas that read alike.
  struct FromSources {
    int32_t instance;
    std::vector<int64_t> signature;
    std::vector<int64_t> load;
  };
  std::deque<FromSources> from_sources;
  for (size_t k = 0; k < instances.size(); ++k) {
    InstancePlan& ip = plan.instances[k];
    ip.instance = instances[k].id;
    ip.layout_class = class_of[k];
    const auto& members = classes[class_of[k]].members;
    const size_t pos =
        std::find(members.begin(), members.end(), k) - members.begin();
    // A binary tree over the class in registration order; an instance that
    // may not be relayed from is skipped on the way up (its children relay
    // from its own parent), and one with no relaying ancestor reads the
    // sources.
    int32_t parent = -1;
    for (size_t at = pos; at > 0;) {
      at = (at - 1) / 2;
      if (instances[members[at]].may_relay) {
        parent = members[at];
        break;
      }
    }
    if (options.relay && parent >= 0) {
      ip.relay_from = parent;
      ip.stage = plan.instances[ip.relay_from].stage + 1;
      std::vector<int64_t>& rank_bytes = class_rank_bytes[class_of[k]];
      if (rank_bytes.empty()) {
        rank_bytes = BytesPerRank(model, *instances[k].layout);
      }
      PlanRelay(rank_bytes, instances[ip.relay_from], instances[k], &ip);
      continue;
    }
    // From the sources: shared with an earlier instance that reads alike.
    std::vector<int64_t> signature = Signature(instances[k]);
    const FromSources* alike = nullptr;
    for (const FromSources& f : from_sources) {
      if (class_of[f.instance] == class_of[k] && f.signature == signature) {
        alike = &f;
        break;
      }
    }
    if (alike == nullptr) {
      from_sources.push_back(FromSources{static_cast<int32_t>(k),
                                         std::move(signature),
                                         std::vector<int64_t>(sources.size())});
      PlanFromSources(model, sources, index_, instances[k], source_node,
                      node_ids, options, fixed_load_,
                      from_sources.back().load, &ip);
      alike = &from_sources.back();
    } else {
      ip = PlanAlike(plan.instances[alike->instance], instances[k]);
      ip.layout_class = class_of[k];
    }
    for (size_t r = 0; r < sources.size(); ++r) {
      plan.bytes_per_source_rank[r] += alike->load[r];
    }
  }
  for (int64_t b : plan.bytes_per_source_rank) plan.source_bytes += b;
  plan.digest = PlanDigest(plan);
  return plan;
}

}  // namespace ferry
