// Adapters: LoRA adapters attached to instances (Lifecycle.LoadAdapter,
// UpdateAdapter, UnloadAdapter; docs/api.md, "LoRA adapters").
//
// An adapter is a stream of its own: the trainer's adapter ranks register
// its lora_A / lora_B tensors as sources, and every training step is a
// version of it. Loading it on an instance registers, per rank of the
// instance, a destination rank of the adapter stream (Registry::
// AttachAdapter) whose memory is daemon staging sized for that rank's
// shares of the tensors (core/adapter_shares.h: lora_B's rows of a column-
// parallel layer, lora_A's columns of a row-parallel one, each fused part
// on its own). From then on the adapter is an ordinary instance of its
// stream, under the id "<instance>:<name>:<n>": every version reaches it
// through the planner (relays and peer bootstraps included), and its events
// go to the engine rank's Subscribe stream with adapter_name set, where the
// APPLY lists the shares for the engine's adapter manager. The base model's
// versions and the adapter's are separate runs on separate streams: an
// adapter version never writes base weights.
//
// UpdateAdapter attaches the new stream or configuration under a new id,
// fills it from a peer instance that holds the stream's latest version
// (the old attachment itself, when the stream is the same), and detaches
// the old one; the engine keeps serving the name meanwhile. The old
// attachment takes part in no version after the update begins (retiring),
// so the engine never sees two sequences for one name. UnloadAdapter sends
// UNLOAD_ADAPTER and detaches, which releases the staging.
//
// An adapter's ranks leave with their engine rank (lease, exit,
// deregistration, SwapModel); a restarted engine loads its adapters again.
// An engine rank on a member's node gets its staging there: the member
// creates and maps it as the adapter rank's memory for transfers
// (Peer.ManageMemory STAGE_ADAPTER, member_memory.h), the coordinator
// registers the rank with that region unmapped, and transfers reach it as
// any rank a member maps; DROP_ADAPTER (or the engine rank leaving through
// the member) releases it. Not built: an offloaded instance
// (FAILED_PRECONDITION), shares written straight into the engine's own
// adapter buffers (they are always staged).
//
// Owner: the LifecycleService. Threading: one adapter change at a time
// (mu_), each call blocking its gRPC thread until the adapter settled.
#ifndef FERRY_DAEMON_LIFECYCLE_ADAPTERS_H_
#define FERRY_DAEMON_LIFECYCLE_ADAPTERS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/adapter_shares.h"
#include "daemon/memory/member_memory.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/participant.h"
#include "daemon/registry/registry.h"
#include "daemon/versions/version_coordinator.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/lifecycle.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

// ferry's reading of a PEFT adapter_config.json: "r" and a list
// "target_modules" (a string there is a regex, which ferry does not
// check). INVALID_ARGUMENT for text that is not a JSON object.
absl::StatusOr<AdapterConfig> ParseAdapterConfig(const std::string& json);

// The adapters attached to each instance (base instance id -> adapters by
// name), as Inspection lists them: one pass over the registry, so listing
// every instance costs one pass, not one per instance.
std::map<std::string, std::vector<v1::AdapterInfo>> AdaptersByInstance(
    const Registry& registry, const VersionCoordinator& coordinator);

// The adapters attached to `instance_id`, by name.
std::vector<v1::AdapterInfo> AdaptersOf(const Registry& registry,
                                        const VersionCoordinator& coordinator,
                                        const std::string& instance_id);

class Adapters {
 public:
  struct Options {
    std::string node;  // this daemon's node
    // How long Load and Update wait for the adapter's first fill.
    absl::Duration fill_wait = absl::Minutes(2);
    // Staging on a member's node for its engine ranks (Peer.ManageMemory
    // STAGE_ADAPTER / DROP_ADAPTER); unset: such a rank is UNIMPLEMENTED.
    ManageRemoteMemory remote_memory;
  };
  Adapters(Registry* registry, PlanCache* plans,
           VersionCoordinator* coordinator, Options options)
      : registry_(registry),
        plans_(plans),
        coordinator_(coordinator),
        options_(std::move(options)) {}

  // `base_stream`: the stream the instance follows. The adapter's status
  // on its stream: COMMITTED when delivered now, IDLE (waiting_reason
  // says why) when it waits for the stream's next version.
  absl::StatusOr<v1::InstanceStatus> Load(
      const std::string& base_stream, const v1::LoadAdapterRequest& request,
      const VersionCoordinator::Expired& expired) ABSL_LOCKS_EXCLUDED(mu_);
  absl::StatusOr<v1::InstanceStatus> Update(
      const std::string& base_stream, const v1::UpdateAdapterRequest& request,
      const VersionCoordinator::Expired& expired) ABSL_LOCKS_EXCLUDED(mu_);
  absl::Status Unload(const v1::UnloadAdapterRequest& request,
                      const VersionCoordinator::Expired& expired)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  // The attachment of `name` on `instance_id` (its rank 0), or null.
  std::shared_ptr<const Participant> FindLocked(const std::string& instance_id,
                                                const std::string& name) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The adapter's ranks for every rank of the instance, staged and mapped,
  // under a new instance id.
  absl::StatusOr<std::vector<std::unique_ptr<Participant>>> BuildRanksLocked(
      const std::string& base_stream, const std::string& instance_id,
      const std::string& name, const std::string& adapter_stream,
      const std::string& config_json) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Releases the staging members hold for `ranks` ((node, participant id);
  // those on this node are skipped); failures are logged.
  void DropOnMembers(
      const std::vector<std::pair<std::string, std::string>>& ranks);
  // The (node, participant id) of an adapter instance's ranks.
  std::vector<std::pair<std::string, std::string>> RanksOf(
      const std::string& adapter_instance) const;
  // Attaches `ranks` and waits for their first fill.
  absl::StatusOr<v1::InstanceStatus> AttachLocked(
      std::vector<std::unique_ptr<Participant>> ranks,
      const VersionCoordinator::Expired& expired)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  Registry* const registry_;
  PlanCache* const plans_;
  VersionCoordinator* const coordinator_;
  const Options options_;
  absl::Mutex mu_;
  uint64_t next_attachment_ ABSL_GUARDED_BY(mu_) = 1;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_LIFECYCLE_ADAPTERS_H_
