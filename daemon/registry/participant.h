// Participant: one registered rank, a trainer rank (source) or an inference
// engine rank (destination), as the daemon keeps it.
//
// Built from a registration request by registration_parser.h (validated,
// memory mapped), then owned by the Registry. Immutable after registration
// except `removed`, so any thread may read a shared_ptr<const Participant>
// without a lock; a transfer holding one keeps the memory mapped even if the
// participant is removed meanwhile. Param indices in pieces refer to the
// participant's own parameter list (`params` / `piece_params`); the stream's
// model, and the plan's indices, are built by the PlanCache.
#ifndef FERRY_DAEMON_REGISTRY_PARTICIPANT_H_
#define FERRY_DAEMON_REGISTRY_PARTICIPANT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/time.h"
#include "core/geometry.h"
#include "core/layout_resolution.h"
#include "core/piece.h"
#include "daemon/memory/memory_map.h"
#include "daemon/registry/adapter_binding.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

enum class Role { kSource, kDestination };

// Participant::removed: set once, read by any thread. A copy of a
// participant (Participant::WithMemory) is a live registration, so the
// flag does not travel with it.
class RemovalFlag {
 public:
  RemovalFlag() = default;
  RemovalFlag(const RemovalFlag&) {}
  RemovalFlag& operator=(const RemovalFlag&) = delete;
  bool load() const { return removed_.load(); }
  void store(bool removed) const { removed_.store(removed); }

 private:
  mutable std::atomic<bool> removed_{false};
};

struct Participant {
  std::string id;     // public, daemon-assigned, never reused
  std::string token;  // secret, returned to the registrant only
  Role role = Role::kSource;
  std::string stream;  // a destination's base stream
  std::string node;
  v1::Device device;
  int32_t pid = 0;
  absl::Time registered_at;
  // Who registered it on this daemon's unix socket (SO_PEERCRED), when
  // known: Lifecycle calls that change an instance are for that user or
  // root (lifecycle_service.h). Unknown for a registration a member
  // forwarded.
  bool owner_known = false;
  uint32_t owner_uid = 0;

  // Source: rank within the stream's world.
  int32_t rank = 0;
  int32_t world_size = 0;
  // Source: declared parameters; `pieces[i].param` indexes them and
  // `pieces[i].buffer` is a dense MemoryMap index. Shared between ranks
  // that declared an equal list (table_interner.h); never null.
  std::shared_ptr<const std::vector<ParamSpec>> params =
      std::make_shared<const std::vector<ParamSpec>>();

  // Destination: the instance, its TP rank and size, the version held.
  std::string instance_id;
  int32_t tp_rank = 0;
  int32_t tp_size = 0;
  int64_t held_version = 0;
  // Destination: asked for its fallback tensors in GPU memory
  // (StagingPlacement DEVICE; staging_area.h).
  bool device_staging = false;
  // Destination registered with an engine table: the table's parameters
  // (buffers are dense MemoryMap indices). Else explicit pieces: `pieces`
  // with `param` indexing `piece_params` (names only: the stream declares
  // the dtypes and shapes).
  bool engine_table = false;
  // Shared between ranks that registered equal tables (the replicas of an
  // engine, rank for rank: table_interner.h); never null.
  std::shared_ptr<const std::vector<EngineParam>> engine_params =
      std::make_shared<const std::vector<EngineParam>>();
  std::vector<std::string> piece_params;

  std::vector<Piece> pieces;  // source pieces or explicit destination pieces

  std::shared_ptr<const MemoryMap> memory;
  // Destination: the regions as registered (Registry.UpdateRegions replaces
  // some of them and maps the set again).
  std::vector<v1::MemoryRegion> regions;

  // Set (once, by the Registry) before listeners hear of the removal.
  RemovalFlag removed;

  // Set for an adapter's destination rank, else null.
  std::shared_ptr<const AdapterBinding> adapter;
  // The participant whose Subscribe stream carries this one's events: the
  // base rank for an adapter's rank, else itself.
  const std::string& channel_id() const {
    return adapter != nullptr ? adapter->base_id : id;
  }

  // "source policy rank 3" / "instance vllm-0 tp rank 1", for messages.
  std::string Describe() const;

  // A destination's checkpoint names it needs from its stream (the
  // Registry checks the stream declares them).
  std::vector<std::string> NeededNames() const;

  // A copy with other memory (Registry.UpdateRegions): same id, token and
  // layout; `removed` false.
  std::unique_ptr<Participant> WithMemory(
      std::shared_ptr<const MemoryMap> new_memory,
      std::vector<v1::MemoryRegion> new_regions) const;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_PARTICIPANT_H_
