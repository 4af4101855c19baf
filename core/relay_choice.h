// Relay choice: whether replicas should relay a version to each other
// across nodes (core/plan.h's binary tree of relays) or each read the
// sources, decided from the cluster's shape alone: ferryd knows which node
// every rank is on, not the bandwidths between them.
//
// The model (core/cluster_model.h measures it): every node has the same NIC
// bandwidth, and time is counted in "models over one node's NICs". Fed
// from the sources, the S nodes that hold them send R copies of the model
// at once: R / S (at least 1, what each replica's node takes in). Relayed,
// the root takes one model in from the sources, then each stage of the
// tree moves, one stage after another, as many models as its busiest
// parent has children (a binary tree: up to 2). So relaying across nodes
// pays when
//
//     serial_models x S <= R
//
// (at a tie the relay is kept: it spares the trainer's NICs). Two replicas
// on two nodes fed by one trainer node relay (2 x 1 <= 2); eight fed by
// one node relay (1 + 2 + 2 + 1 = 6 <= 8); four fed by four trainer nodes
// do not (1 + 2 + 1 = 4, x 4 > 4), which at 64 GPUs made Qwen3-235B's
// modeled version 3.7x slower with relays than without. Replicas on one
// node always relay: that copy never leaves the node.
//
// Pure; any thread.
#ifndef FERRY_CORE_RELAY_CHOICE_H_
#define FERRY_CORE_RELAY_CHOICE_H_

#include <vector>

#include "core/plan.h"

namespace ferry {

// The relay tree an instance of a plan belongs to: how many replicas it
// has (its root, fed by the sources, included), how many stages it takes
// (its deepest stage + 1), and the models its busiest nodes move one after
// another (above).
struct RelayTree {
  int replicas = 1;
  int stages = 1;
  int serial_models = 1;
};

// By plan instance.
std::vector<RelayTree> RelayTrees(const Plan& plan);

// Whether the tree should relay between nodes, with the sources on
// `source_nodes` distinct nodes.
bool CrossNodeRelayPays(int source_nodes, const RelayTree& tree);

// Where ferryd runs instance k's relay from its plan's relay_from
// (daemon/versions/transfer_queue.cc), once that replica landed: only between
// instances that sit on one node each, and between two nodes only where
// the tree pays; for an instance with fallback tensors only where the
// coordinator is on both their nodes (staging is not relayed between
// daemons). Everywhere else the instance reads the sources.
enum class RelayWhere {
  kNever,              // no relay_from, or a relay ferryd does not run
  kAlways,             // wherever the coordinator is
  kCoordinatorsNode,   // only with the coordinator on the one node of both
};
// `trees` is RelayTrees(plan) and `source_nodes` the distinct nodes of the
// sources. With the coordinator on none of the nodes (as on Kubernetes,
// and as the cluster model assumes) a relay runs where this is kAlways.
RelayWhere WhereRelayRuns(const Plan& plan,
                          const std::vector<Instance>& instances, int32_t k,
                          const std::vector<RelayTree>& trees,
                          int source_nodes);

// The distinct nodes of `sources`.
int SourceNodes(const std::vector<RankLayout>& sources);

}  // namespace ferry

#endif  // FERRY_CORE_RELAY_CHOICE_H_
