// Transfer routes: how one instance's transfer splits between daemons.
//
// Role: RouteSender (route_sender.h), the sending side, turns a
// TransferJob (the plan's copies of one instance, or a relay from a
// replica) into Moves (one box from a source piece into a destination
// rank's piece, bucket by bucket in plan order), and the Moves into one
// NodeRoute per (source node, destination node): the RunTransfer request the
// destination's node (or the sources' node) gets, the BucketViews of the
// boxes whose sources are mapped on this node, and, for a route that
// stays on this node, the views of their destinations. Everything a route
// would refuse (GPU memory into host staging over NCCL, a relay out of a
// replica's staging, memory that is not mapped) is refused here, before
// any byte moves.
//
// Pure over the job: no daemon state, no locks. Any thread.
#ifndef FERRY_DAEMON_TRANSFER_TRANSFER_ROUTES_H_
#define FERRY_DAEMON_TRANSFER_TRANSFER_ROUTES_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/geometry.h"
#include "core/piece.h"
#include "daemon/registry/participant.h"
#include "daemon/transfer/transfer_job.h"
#include "proto/ferry/v1/peer.pb.h"
#include "transport/transport.h"

namespace ferry {

// One box of a job: from a source piece (a trainer rank's, or for a relay
// the same piece of the replica it relays from) into destination rank
// `dst_rank`'s piece.
struct Move {
  const Participant* source;
  const Piece* src;
  int32_t dst_rank;
  const Piece* dst;
  Box box;
  int32_t param;
};

// The job's boxes, bucket by bucket in plan order.
std::vector<std::vector<Move>> MovesOf(const TransferJob& job);

// Where each box of each bucket of a view list is, in the same order.
using Places = std::vector<std::vector<BufferPlace>>;

// (source node, destination node).
using RouteKey = std::pair<std::string, std::string>;

struct NodeRoute {
  v1::RunTransferRequest req;     // the receiver's part (+ "send" part)
  std::vector<BucketView> views;  // sources on this node
  std::vector<BucketView> local;  // this node -> this node: destinations
  Places view_places, local_places;  // where each box of those is
  int64_t bytes = 0;
};

struct NodeRoutes {
  std::map<RouteKey, NodeRoute> by_key;
  std::vector<RouteKey> order;  // first use, which is plan order
};

// The job's routes as seen from daemon `node`; `timeout` is each
// RunTransfer's, `next_bucket_id` numbers the buckets (unique per daemon).
// INTERNAL / UNIMPLEMENTED for a job no route can carry (above).
absl::StatusOr<NodeRoutes> BuildRoutes(
    const TransferJob& job, const std::string& node, absl::Duration timeout,
    const std::function<uint64_t()>& next_bucket_id);

// Whether the job reaches a node other than `node` (RouteSender::Handles):
// its destination ranks, or with them all on `node`, the replica it relays
// from, the partner it exchanges with, or its sources.
bool ReachesOtherNodes(const TransferJob& job, const std::string& node);

// The staging of the job's ranks on `node` (the coordinator's own, already
// reserved), added to `staging` by participant id.
void AddStagingHere(const TransferJob& job, const std::string& node,
                    std::map<std::string, v1::ParticipantStaging>* staging);

// Each destination rank's APPLY detail: the staging regions and fallback
// slots on its own node (`staging`, by participant id).
std::vector<v1::ApplyDetail> ApplyDetailsOf(
    const TransferJob& job,
    const std::map<std::string, v1::ParticipantStaging>& staging);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_TRANSFER_ROUTES_H_
