// Exchange: pairs of replicas that read the sources alike split the
// busiest senders' buckets between them and pass each other their halves,
// so those senders send such a bucket once per pair instead of once per
// replica.
//
// Why: when every engine rank reads its own bytes from the trainer, the
// trainer nodes that hold a shard must send it once per replica through
// their own NICs (the sender bound, core/cluster_model.h). Where a PP
// stage holds more than its share (DeepSeek-V3 with PP 8: 8 of the 58 MoE
// layers on some stages, 7.25 on average), those NICs are busier than any
// receiver's, and no choice of holders helps. The receivers' NICs out are
// idle meanwhile: they can carry the second copy.
//
// How ferryd runs it (daemon/versions/transfer_queue.cc): a replica `a` with an
// exchange takes its transfer in two parts. First every bucket of its
// copies that it is not given, from the sources; then the buckets it is
// given, rank r from its partner's rank r (the same pieces: the two share
// one layout and one copy list). The buckets given to a and to its
// partner are disjoint, so the partner holds a's once its own first part
// has landed: neither waits for the other's second part. When the
// partner cannot give them (it failed, left the version, or its memory
// went away mid-copy), a reads them from the sources instead.
//
// The choice: bytes are counted per rank (each rank a GPU with a NIC of
// its own, all alike), on NICs only (a copy inside a node is free here):
// in the first part, each source rank's bytes out and each engine rank's
// bytes in; in the second, each engine rank's exchanged bytes in and out.
// A version takes about the busiest port of the first part plus the
// busiest of the second (plus one bucket to fill its pipe), as the cluster
// model counts it. For a cap C on a source rank's first-part bytes,
// buckets are given away (the busiest source ranks first, each one's
// largest buckets first, to the side of the pair whose second part is
// lighter) until no source rank sends more than C. C is tried at 16 steps
// from the busiest source rank's bytes down to half of them; the fastest
// is kept, or the first (least exchanged) within 2% of it, since every
// exchanged byte also loads the channels between the two replicas' nodes.
// Where receivers are the busiest ports, nothing is exchanged.
//
// Which replicas pair: instances whose plans share their copies and
// buckets (SourcePlanner::PlanAlike), that may serve as a peer
// (Instance::may_relay), on nodes that hold no source rank and that the
// two do not share, taken two by two in plan order. A bucket with a
// fallback tensor's staging piece is never exchanged (staging is not read
// across nodes).
//
// Pure and deterministic: every daemon computes the same. Any thread.
#ifndef FERRY_CORE_EXCHANGE_H_
#define FERRY_CORE_EXCHANGE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "core/piece.h"
#include "core/plan.h"
#include "core/planner.h"

namespace ferry {

// What one instance is given by its partner.
struct Exchange {
  int32_t partner = -1;  // instance index; -1: no exchange
  // Indices into its plan's buckets, ascending: what the partner gives.
  std::vector<int32_t> buckets;
  int64_t bytes = 0;  // their bytes

  bool given(int32_t bucket) const;  // whether `bucket` is in `buckets`
};

// `plans[k]`: what instance k reads from the sources, or null where it
// does not (it relays). By instance; an entry with partner -1 where the
// instance exchanges nothing.
std::vector<Exchange> ChooseExchanges(
    const std::vector<RankLayout>& sources,
    const std::vector<Instance>& instances,
    const std::vector<const InstancePlan*>& plans, int64_t bucket_bytes);

// The exchanges of `plan` (`planner`'s PlanInstances over `instances`) as
// ferryd chooses them, its coordinator on none of their nodes: over what
// each instance reads from the sources where its relay does not run
// (WhereRelayRuns is not kAlways). That is its own copies, or for a
// replica whose plan relays, `from_sources(k)` (what it reads from the
// sources: SourcePlanner::PlanFromSourcesOf) when it reads alike with its
// tree's root; one that does not is left out (only replicas that share
// their copies pair, and planning it alone costs a plan).
std::vector<Exchange> ChooseExchanges(
    const SourcePlanner& planner, const std::vector<RankLayout>& sources,
    const std::vector<Instance>& instances, const Plan& plan,
    const std::function<const InstancePlan&(int32_t)>& from_sources);

}  // namespace ferry

#endif  // FERRY_CORE_EXCHANGE_H_
