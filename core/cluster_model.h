// Cluster model: what one version of a plan puts on a cluster's links, and
// how close that is to the best any plan could do.
//
// Every rank is a GPU: a node's ranks take its GPU slots in the order the
// sources, then the instances' ranks, appear (a node with a trainer and an
// engine rank has them on different GPUs; time-shared colocation is not
// modelled). A copy between GPUs of one node crosses the node's NVLink
// fabric (the sender's and the receiver's NVLink ports); between nodes it
// leaves through the sender's NIC and enters through the receiver's. A
// replica that relays receives rank r from its relay source's rank r, the
// same bytes its class's first instance received from the trainer.
//
// Modeled time of one version, as the plan allows it: the instances of one
// relay stage move at once, each port streaming at its full rate, so a
// stage takes its busiest port's bytes over its bandwidth plus one bucket
// to fill the pipe; a replica relays once its source holds the version (as
// ferryd waits), so stages follow one another; the second parts of
// exchanges (core/exchange.h: replicas passing each other buckets) are one
// stage more, after the others. Beside it, the time as
// ferryd runs it: the instances of a stage in waves of transfer_workers
// (in plan order), each instance's routes (one per pair of nodes) in
// waves of routes_at_once, and each route between two nodes striped over
// `rails` NICs of each (ferryd --rails: a channel per rail pair), which
// the node's routes in a wave share (NVLink's rate inside a node): a wave
// takes the longer of its busiest port (a node's rails together, a GPU's
// NVLink) and its slowest instance's routes, plus one bucket.
// The lower bound: for every node, the
// bytes its GPUs need that no GPU of the node holds at the start (each
// distinct box counted once, however many of its GPUs need it: they can
// share it over NVLink), over the node's NIC bandwidth in; the maximum
// over nodes. No plan can beat it: those bytes must enter the node through
// its NICs. Bytes a node holds are those of the trainer ranks on it.
//
// The sender bound, for plans without forwarding (every engine rank reads
// its own bytes from trainer ranks: no relay, no sharing over NVLink):
// trainer nodes that share a shard (DP replicas) form a group; the bytes
// engine ranks on other nodes need of the shards a group holds must leave
// through the group's NICs. The maximum over groups is what such a plan
// cannot beat, however it chooses holders. Where it exceeds the lower
// bound, only forwarding (relays, exchanges) can close the gap.
#ifndef FERRY_CORE_CLUSTER_MODEL_H_
#define FERRY_CORE_CLUSTER_MODEL_H_

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/exchange.h"
#include "core/model_spec.h"
#include "core/piece.h"
#include "core/plan.h"
#include "core/validation.h"

namespace ferry {

struct ClusterSpec {
  int gpus_per_node = 8;
  double nic_gbits = 400;     // per GPU, each direction, Gb/s
  double nvlink_gbytes = 450;  // per GPU, each direction, GB/s (H100: 450)
  // ferryd's concurrency (--transfer_workers; RouteSender's routes of
  // one instance at once).
  int transfer_workers = 8;
  int routes_at_once = 16;
  // NICs a route between two nodes is striped over (ferryd --rails); 0:
  // one per GPU (gpus_per_node). 1: every route on one NIC, as ferryd
  // without --rails.
  int rails = 0;
  // Delta versions (ferry_plan --delta_density): the fraction of bf16
  // elements a version changes; bytes between nodes shrink to what a
  // patch of that density costs (PatchFraction). Negative: every byte.
  double delta_density = -1;
};

// What a patch of 2-byte elements costs per byte of its bucket when
// `density` of them changed (transport/bucket_patch.h): the changed bytes,
// plus the smaller of a bitmap (1/16) and an index list (4 bytes a change);
// 1 when that is not smaller than the bucket (it goes dense).
double PatchFraction(double density);

// Parses "gpus_per_node=8,nic_gbits=400,nvlink_gbytes=450,
// transfer_workers=8,rails=8" (any subset).
absl::StatusOr<ClusterSpec> ParseClusterSpec(const std::string& text);

// One GPU's ports, bytes in one version.
struct GpuLoad {
  std::string node;
  int slot = 0;  // GPU index within its node
  int64_t nic_out = 0, nic_in = 0;
  int64_t nvlink_out = 0, nvlink_in = 0;
};

struct ClusterReport {
  std::vector<GpuLoad> gpus;  // by node, then slot
  // The busiest port and its time.
  std::string busiest;  // "NIC in of infer-3 GPU 5"
  double busiest_s = 0;
  double pipeline_s = 0;  // fill and drain, all stages
  double modeled_s = 0;   // sum over stages: busiest port + one bucket
  std::vector<double> stage_s;  // by relay stage
  double ferryd_s = 0;    // as ferryd runs it (above)
  int transfer_workers = 0, routes_at_once = 0;  // what ferryd_s assumed
  int rails = 0;
  // Max over nodes of the bytes they must receive over their NICs.
  std::string bound_node;
  int64_t bound_bytes = 0;
  double lower_bound_s = 0;
  double ratio = 0;  // modeled / lower bound (0 when the bound is 0)
  // The sender bound without forwarding (above): its busiest group of
  // trainer nodes, the bytes they must send, and its time.
  std::vector<std::string> sender_bound_nodes;
  int64_t sender_bound_bytes = 0;
  int sender_bound_nics = 0;  // the GPUs of those nodes, a NIC each
  double sender_bound_s = 0;
  int max_stage = 0;  // longest relay chain
  int64_t cross_node_bytes = 0, intra_node_bytes = 0;
  int64_t exchanged_bytes = 0;  // given by partners (core/exchange.h)
  std::vector<std::string> assumptions;
};

// `instances` and `plan` as PlanTransfers took and made them.
// `direct_plan` (optional: by instance, what each relayed instance copies
// from the sources; ferryd plans them with SourcePlanner::PlanAlone, and
// entries of instances that do not relay are not read) is used as ferryd
// uses it, its coordinator on none of these nodes: a
// replica whose relay ferryd would not run (it or its source spans nodes,
// or it has fallback tensors, whose staging is relayed only on the
// coordinator's node) reads the trainer instead, in the first stage.
// `source_index` (optional: SourcePlanner::index() of the planner that
// made `plan`) spares validating the sources again for the sender bound.
// `exchanges` (optional: by instance, ChooseExchanges over what each
// instance reads from the sources) are run as ferryd runs them: an
// instance that reads the sources takes the buckets its partner gives it
// from the partner, in the exchanges' stage.
// `source_gpu_of` (optional: by source rank, an earlier source rank whose
// GPU it runs on, or -1 for a GPU of its own) places sources that are not
// GPUs of their own (FP8 in flight's quantizer ranks on the trainer's
// GPUs, tools/quantizer_gpus.h).
absl::StatusOr<ClusterReport> ModelCluster(
    const ModelSpec& model, const std::vector<RankLayout>& sources,
    const std::vector<Instance>& instances, const Plan& plan,
    const ClusterSpec& cluster, const Plan* direct_plan = nullptr,
    const SourceIndex* source_index = nullptr,
    const std::vector<Exchange>* exchanges = nullptr,
    const std::vector<int>* source_gpu_of = nullptr);

std::string FormatClusterReport(const ClusterReport& r);
std::string ClusterReportJson(const ClusterReport& r);

}  // namespace ferry

#endif  // FERRY_CORE_CLUSTER_MODEL_H_
