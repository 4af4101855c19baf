// RouteMemory: the memory that routes between daemons read and write on
// this node (docs/architecture.md, "Several nodes"), shared by the two
// sides of the data path:
//  - a member's participants registered through this daemon (AddLocal,
//    from the forwarding services, forwarding.h) and the staging it reserves for their fallback
//    tensors (kept across versions, bounded by --max_staging_mb);
//  - on the coordinator, the destination ranks of this node that a
//    member's route lands in, registered by RouteSender::Execute for its
//    duration (Expect / Unexpect).
// ViewsOf turns a RunTransfer request's buckets into views of that memory
// (RouteReceiver's roles); CopyViews and PinForFabric are the steps both
// sides share for parts on one node and NCCL routes.
//
// Owner: the Server; RouteSender and RouteReceiver hold it, not owned.
// Threading: thread-safe (one mutex for the maps). The views ViewsOf
// returns stay valid while the KeepAlive it filled is held.
#ifndef FERRY_DAEMON_TRANSFER_ROUTE_MEMORY_H_
#define FERRY_DAEMON_TRANSFER_ROUTE_MEMORY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "daemon/memory/memory_map.h"
#include "daemon/memory/staging_area.h"
#include "daemon/transfer/copy_router.h"
#include "daemon/transfer/route_options.h"
#include "daemon/transfer/transfer_job.h"
#include "daemon/transfer/transfer_routes.h"
#include "proto/ferry/v1/peer.pb.h"
#include "transport/device_memory.h"
#include "transport/transport.h"

namespace ferry {

// The memory a part's views point into (participants' maps, staging),
// held until the part is done: a participant that deregisters meanwhile
// (an engine exiting after its commit while a replica relays from it)
// must not have its memory unmapped under a copy.
using KeepAlive = std::vector<std::shared_ptr<const void>>;

// The buckets of one side of a RunTransfer request as views of memory
// mapped here, and where each box is.
struct RouteViews {
  std::vector<BucketView> views;
  Places places;
};

class RouteMemory {
 public:
  // Uses options.node, devices and max_staging_bytes.
  explicit RouteMemory(const RouteOptions& options);
  RouteMemory(const RouteMemory&) = delete;
  RouteMemory& operator=(const RouteMemory&) = delete;

  // Member: memory of a participant registered through this daemon.
  void AddLocal(const std::string& participant_id,
                std::shared_ptr<const MemoryMap> memory)
      ABSL_LOCKS_EXCLUDED(mu_);
  void RemoveLocal(const std::string& participant_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Member: memory this daemon derives from participants' (FP8 in flight's
  // quantizer rank, route_quantizers.h), read by routes as a participant
  // `id`'s; dropped with the first of `reads` that RemoveLocal drops.
  void AddDerived(const std::string& id,
                  std::shared_ptr<const MemoryMap> memory,
                  const std::vector<std::string>& reads)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Member: the bytes of the participants registered through this daemon
  // (not derived memory), which bound what may be derived from them.
  int64_t LocalBytes() ABSL_LOCKS_EXCLUDED(mu_);
  // Member: that memory, or null (Peer.HashBoxes reads it).
  std::shared_ptr<const MemoryMap> LocalMemory(
      const std::string& participant_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Staging this daemon holds for ranks it maps as a member (RunTransfer's
  // receiving side), bytes: the /metrics staging gauge of a member.
  int64_t StagingBytesInUse() ABSL_LOCKS_EXCLUDED(mu_);

  // Coordinator: rank `participant_id` of this node receives a member's
  // route into `memory` (the memory and staging it mapped) until Unexpect.
  void Expect(const std::string& participant_id, RankMemory memory)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Unexpect(const std::string& participant_id) ABSL_LOCKS_EXCLUDED(mu_);

  // Under one lock: with `reserve`, staging on this node for the request's
  // fallback tensors (named in `response`); then, where non-null, the
  // views of request.send() into `send` and of request.receive() into
  // `receive` (staging buffers resolve to the reserved slots).
  // UNIMPLEMENTED for GPU memory unless `gpu_ok` (same-node parts, NCCL
  // routes); NOT_FOUND for a participant not registered here;
  // RESOURCE_EXHAUSTED over the staging limit.
  absl::Status ViewsOf(const v1::RunTransferRequest& request, bool reserve,
                       bool gpu_ok, v1::RunTransferResponse* response,
                       RouteViews* send, RouteViews* receive,
                       KeepAlive* keep) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // Staging slot k, by participant id.
  using StagingBases = std::map<std::string, std::map<int32_t, BufferPlace>>;

  absl::Status ReserveStagingLocked(const v1::RunTransferRequest& request,
                                    v1::RunTransferResponse* response,
                                    StagingBases* staging_bases,
                                    KeepAlive* keep)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  absl::Status ViewsLocked(
      const google::protobuf::RepeatedPtrField<v1::TransferBucket>& buckets,
      const StagingBases& staging_bases, bool gpu_ok, RouteViews* out,
      KeepAlive* keep) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string node_;
  DeviceMemory* const devices_;
  const int64_t max_staging_bytes_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const MemoryMap>> local_
      ABSL_GUARDED_BY(mu_);
  // Derived entries of local_, by the participant ids they read.
  std::map<std::string, std::set<std::string>> readers_ ABSL_GUARDED_BY(mu_);
  std::set<std::string> derived_ ABSL_GUARDED_BY(mu_);
  // Member: staging for fallback tensors, by participant id.
  std::map<std::string, std::shared_ptr<StagingArea>> staging_
      ABSL_GUARDED_BY(mu_);
  // Coordinator: destination ranks on this node that a member's route is
  // being received into (during Execute), by participant id.
  std::map<std::string, RankMemory> receiving_ ABSL_GUARDED_BY(mu_);
};

// Copies box j of from[i] into box j of to[i], each with the engine
// `router` picks for its places; returns the bytes copied. Every box is
// routed before any byte moves.
absl::StatusOr<int64_t> CopyViews(const CopyRouter& router,
                                  const std::vector<BucketView>& from,
                                  Places& from_places,
                                  const std::vector<BucketView>& to,
                                  Places& to_places,
                                  const std::function<bool()>& cancelled,
                                  const std::function<void(int64_t)>& on_bytes);

// Pins the host places among `places` for the GPUs (an NCCL route's boxes
// on this side); UNIMPLEMENTED for staging that is not pinned.
absl::Status PinForFabric(Places& places, DeviceMemory* devices);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_ROUTE_MEMORY_H_
