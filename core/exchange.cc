#include "core/exchange.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "core/relay_choice.h"

namespace ferry {

bool Exchange::given(int32_t bucket) const {
  return std::binary_search(buckets.begin(), buckets.end(), bucket);
}

namespace {

// One bucket's bytes by source rank and by destination rank.
struct BucketLoad {
  std::vector<std::pair<int32_t, int64_t>> by_src;
  std::vector<std::pair<int32_t, int64_t>> by_dst;
  int64_t bytes = 0;
  bool exchangeable = true;  // no staging piece
};

void Add(std::vector<std::pair<int32_t, int64_t>>* v, int32_t key,
         int64_t bytes) {
  // A bucket is one route: at most a node's ranks on either side.
  for (auto& [k, b] : *v) {
    if (k == key) {
      b += bytes;
      return;
    }
  }
  v->emplace_back(key, bytes);
}

// Instances that share one copy list.
struct Group {
  std::vector<int32_t> members;  // plan order
  std::vector<BucketLoad> buckets;
  std::vector<std::pair<int32_t, int32_t>> pairs;
};

// Bytes on each NIC: source ranks by index, engine ranks at
// engine_base[k] + r.
struct Loads {
  std::vector<int64_t> out1, in1;  // first part
  std::vector<int64_t> in2, out2;  // second part, engine ranks
  bool any = false;

  int64_t Time(int64_t bucket_bytes) const {
    int64_t first = 0, second = 0;
    for (int64_t b : out1) first = std::max(first, b);
    for (int64_t b : in1) first = std::max(first, b);
    for (int64_t b : in2) second = std::max(second, b);
    for (int64_t b : out2) second = std::max(second, b);
    return first + (any ? second + bucket_bytes : 0);
  }
};

class Chooser {
 public:
  Chooser(const std::vector<RankLayout>& sources,
          const std::vector<Instance>& instances,
          const std::vector<const InstancePlan*>& plans, int64_t bucket_bytes)
      : sources_(sources), instances_(instances), plans_(plans),
        bucket_bytes_(bucket_bytes) {}

  std::vector<Exchange> Choose() {
    std::vector<Exchange> out(instances_.size());
    if (!Prepare()) return out;
    // Step 0 is no exchange at all. The fastest step is kept, or the
    // first (the least exchanged) within 2% of it: every exchanged byte
    // also loads the channels between the two replicas' nodes.
    std::vector<int64_t> times;
    for (int step = 0; step <= 16; ++step) {
      Loads loads = base_;
      if (step > 0) Run(Cap(step), &loads, nullptr);
      times.push_back(loads.Time(bucket_bytes_));
    }
    const int64_t best = *std::min_element(times.begin(), times.end());
    int best_step = 0;
    while (times[best_step] > best + best / 50) ++best_step;
    if (best_step == 0) return out;
    Loads loads = base_;
    Run(Cap(best_step), &loads, &out);
    for (Exchange& e : out) std::sort(e.buckets.begin(), e.buckets.end());
    return out;
  }

 private:
  int64_t Cap(int step) const {
    return busiest_source_ - busiest_source_ * step / 32;
  }

  // Groups, pairs and the loads without exchange; false when nothing can
  // be exchanged.
  bool Prepare() {
    std::set<std::string> source_nodes;
    for (const RankLayout& s : sources_) source_nodes.insert(s.node);
    std::vector<int32_t> engine_base(instances_.size(), 0);
    int32_t engine_ranks = 0;
    for (size_t k = 0; k < instances_.size(); ++k) {
      engine_base[k] = engine_ranks;
      engine_ranks += static_cast<int32_t>(instances_[k].layout->size());
    }
    engine_base_ = engine_base;
    base_.out1.assign(sources_.size(), 0);
    candidates_.resize(sources_.size());
    base_.in1.assign(engine_ranks, 0);
    base_.in2.assign(engine_ranks, 0);
    base_.out2.assign(engine_ranks, 0);

    // By the storage of its copies and buckets (PlanAlike shares both).
    std::map<std::pair<const void*, const void*>, size_t> group_of;
    for (size_t k = 0; k < instances_.size(); ++k) {
      const InstancePlan* p = plans_[k];
      if (p == nullptr) continue;
      const std::pair<const void*, const void*> key(&p->copies.get(),
                                                    &p->buckets.get());
      auto [it, added] = group_of.emplace(key, groups_.size());
      if (added) {
        groups_.emplace_back();
        Breakdown(k, &groups_.back());
      }
      groups_[it->second].members.push_back(static_cast<int32_t>(k));
      CountBase(k, groups_[it->second]);
    }
    for (int64_t b : base_.out1) busiest_source_ = std::max(busiest_source_, b);
    int64_t busiest_receiver = 0;
    for (int64_t b : base_.in1) {
      busiest_receiver = std::max(busiest_receiver, b);
    }
    if (busiest_source_ <= busiest_receiver) return false;

    auto nodes_of = [&](int32_t k) {
      std::set<std::string> n;
      for (size_t r = 0; r < instances_[k].layout->size(); ++r) {
        n.insert(instances_[k].node(r));
      }
      return n;
    };
    bool any_pair = false;
    for (size_t g = 0; g < groups_.size(); ++g) {
      Group& group = groups_[g];
      int32_t pending = -1;
      std::set<std::string> pending_nodes;
      for (int32_t k : group.members) {
        const std::set<std::string> nodes = nodes_of(k);
        bool eligible = instances_[k].may_relay;
        for (const std::string& n : nodes) {
          if (source_nodes.count(n) > 0) eligible = false;
        }
        if (!eligible) continue;
        bool shared = false;
        for (const std::string& n : nodes) {
          if (pending_nodes.count(n) > 0) shared = true;
        }
        if (pending < 0 || shared) {
          pending = k;
          pending_nodes = nodes;
          continue;
        }
        group.pairs.emplace_back(pending, k);
        pending = -1;
        pending_nodes.clear();
      }
      if (group.pairs.empty()) continue;
      any_pair = true;
      // Candidates: by source rank, the exchangeable buckets it sends in.
      for (size_t t = 0; t < group.buckets.size(); ++t) {
        const BucketLoad& b = group.buckets[t];
        if (!b.exchangeable) continue;
        for (const auto& [s, bytes] : b.by_src) {
          candidates_[s].push_back(
              std::make_tuple(bytes, static_cast<int32_t>(g),
                              static_cast<int32_t>(t)));
        }
      }
    }
    if (!any_pair) return false;
    for (auto& list : candidates_) {
      std::sort(list.begin(), list.end(), [](const auto& x, const auto& y) {
        if (std::get<0>(x) != std::get<0>(y)) {
          return std::get<0>(x) > std::get<0>(y);
        }
        return std::make_pair(std::get<1>(x), std::get<2>(x)) <
               std::make_pair(std::get<1>(y), std::get<2>(y));
      });
    }
    for (size_t s = 0; s < base_.out1.size(); ++s) {
      heavy_.push_back(static_cast<int32_t>(s));
    }
    std::stable_sort(heavy_.begin(), heavy_.end(), [&](int32_t a, int32_t b) {
      return base_.out1[a] > base_.out1[b];
    });
    return true;
  }

  // Each bucket's bytes per source and destination rank (all its copies,
  // whether or not they cross nodes: CountBase and Run look at routes).
  void Breakdown(size_t k, Group* group) const {
    const InstancePlan& ip = *plans_[k];
    const std::vector<RankLayout>& layout = *instances_[k].layout;
    group->buckets.resize(ip.buckets.size());
    for (size_t t = 0; t < ip.buckets.size(); ++t) {
      const Bucket& bucket = ip.buckets[t];
      BucketLoad& load = group->buckets[t];
      load.bytes = bucket.bytes;
      for (int32_t c = bucket.first_copy;
           c < bucket.first_copy + bucket.num_copies; ++c) {
        const Copy& copy = ip.copies[c];
        Add(&load.by_src, copy.src_rank, copy.bytes);
        Add(&load.by_dst, copy.dst_rank, copy.bytes);
        if (layout[copy.dst_rank].pieces[copy.dst_piece].buffer &
            kStagingBufferBit) {
          load.exchangeable = false;
        }
      }
    }
  }

  // Instance k's first-part loads with nothing exchanged: the buckets of
  // its routes between nodes.
  void CountBase(size_t k, const Group& group) {
    const InstancePlan& ip = *plans_[k];
    for (size_t t = 0; t < ip.buckets.size(); ++t) {
      const Route& route = ip.routes[ip.buckets[t].route];
      if (route.src_node == route.dst_node) continue;
      const BucketLoad& load = group.buckets[t];
      for (const auto& [s, b] : load.by_src) base_.out1[s] += b;
      for (const auto& [r, b] : load.by_dst) {
        base_.in1[engine_base_[k] + r] += b;
      }
    }
  }

  // Gives buckets away until no source rank sends more than `cap` (or
  // nothing more can be given); records them in `out` when not null.
  void Run(int64_t cap, Loads* loads, std::vector<Exchange>* out) {
    std::vector<std::vector<std::vector<int8_t>>> taken(groups_.size());
    for (size_t g = 0; g < groups_.size(); ++g) {
      taken[g].assign(groups_[g].pairs.size(),
                      std::vector<int8_t>(groups_[g].buckets.size(), 0));
    }
    for (int32_t s : heavy_) {
      if (loads->out1[s] <= cap) continue;
      for (const auto& [bytes, g, t] : candidates_[s]) {
        if (loads->out1[s] <= cap) break;
        const Group& group = groups_[g];
        const BucketLoad& load = group.buckets[t];
        for (size_t p = 0; p < group.pairs.size(); ++p) {
          if (loads->out1[s] <= cap) break;
          if (taken[g][p][t]) continue;
          taken[g][p][t] = 1;
          const auto [a, b] = group.pairs[p];
          // The side whose second part stays lighter is given it.
          auto cost = [&](int32_t given, int32_t giver) {
            int64_t worst = 0;
            for (const auto& [r, rb] : load.by_dst) {
              worst = std::max(worst,
                               loads->in2[engine_base_[given] + r] + rb);
              worst = std::max(worst,
                               loads->out2[engine_base_[giver] + r] + rb);
            }
            return worst;
          };
          const bool to_a = cost(a, b) <= cost(b, a);
          const int32_t given = to_a ? a : b, giver = to_a ? b : a;
          for (const auto& [src, sb] : load.by_src) loads->out1[src] -= sb;
          for (const auto& [r, rb] : load.by_dst) {
            loads->in1[engine_base_[given] + r] -= rb;
            loads->in2[engine_base_[given] + r] += rb;
            loads->out2[engine_base_[giver] + r] += rb;
          }
          loads->any = true;
          if (out != nullptr) {
            Exchange& e = (*out)[given];
            e.partner = giver;
            e.buckets.push_back(t);
            e.bytes += load.bytes;
          }
        }
      }
    }
  }

  const std::vector<RankLayout>& sources_;
  const std::vector<Instance>& instances_;
  const std::vector<const InstancePlan*>& plans_;
  const int64_t bucket_bytes_;
  std::vector<int32_t> engine_base_;
  std::vector<Group> groups_;
  Loads base_;
  int64_t busiest_source_ = 0;
  // By source rank: (its bytes in the bucket, group, bucket), largest
  // first.
  std::vector<std::vector<std::tuple<int64_t, int32_t, int32_t>>>
      candidates_;
  std::vector<int32_t> heavy_;  // source ranks, busiest first
};

}  // namespace

std::vector<Exchange> ChooseExchanges(
    const std::vector<RankLayout>& sources,
    const std::vector<Instance>& instances,
    const std::vector<const InstancePlan*>& plans, int64_t bucket_bytes) {
  return Chooser(sources, instances, plans, bucket_bytes).Choose();
}

std::vector<Exchange> ChooseExchanges(
    const SourcePlanner& planner, const std::vector<RankLayout>& sources,
    const std::vector<Instance>& instances, const Plan& plan,
    const std::function<const InstancePlan&(int32_t)>& from_sources) {
  const std::vector<RelayTree> trees = RelayTrees(plan);
  const int source_nodes = SourceNodes(sources);
  std::vector<const InstancePlan*> reads(plan.instances.size(), nullptr);
  for (size_t i = 0; i < plan.instances.size(); ++i) {
    const int32_t k = static_cast<int32_t>(i);
    if (WhereRelayRuns(plan, instances, k, trees, source_nodes) ==
        RelayWhere::kAlways) {
      continue;
    }
    if (plan.instances[k].relay_from < 0) {
      reads[k] = &plan.instances[k];
    } else if (planner.ReadAlike(instances[RelayRoot(plan, k)],
                                 instances[k])) {
      reads[k] = &from_sources(k);
    }
  }
  return ChooseExchanges(sources, instances, reads, plan.bucket_bytes);
}

}  // namespace ferry
