// AdapterBinding: what makes a destination rank a LoRA adapter's
// (daemon/lifecycle/adapters.h): the engine rank it belongs to, the adapter's name
// and configuration, and the daemon staging that holds the rank's shares
// of the adapter's tensors.
#ifndef FERRY_DAEMON_REGISTRY_ADAPTER_BINDING_H_
#define FERRY_DAEMON_REGISTRY_ADAPTER_BINDING_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/geometry.h"
#include "daemon/memory/staging_area.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

// A LoRA adapter's destination rank (daemon/lifecycle/adapters.h): the daemon
// registers one per rank of the instance the adapter is loaded on, on the
// adapter's stream, holding that rank's shares of the adapter's tensors in
// daemon staging. It has no Subscribe stream of its own: its events go to
// its base rank's stream with adapter_name set.
struct AdapterBinding {
  std::string base_id;        // the engine rank's participant id
  std::string base_instance;  // that rank's instance
  std::string name;           // the adapter name requests use
  std::string config_json;    // PEFT adapter_config.json, passed on unread
  // One slot, "shares", holding every share: here for a rank on this
  // daemon's node; null for one on a member's node, whose member holds it
  // (Peer.ManageMemory STAGE_ADAPTER).
  std::shared_ptr<StagingArea> staging;
  // That staging as the engine rank maps it (in every adapter APPLY).
  v1::MemoryRegion exported;
  struct Share {
    std::string parameter;  // the adapter tensor
    DType dtype = DType::kInvalid;
    Dims shape;  // the tensor's global shape
    Box box;     // the share
    bool whole = false;
    int64_t byte_offset = 0;  // in the slot
    int64_t bytes = 0;
  };
  std::vector<Share> shares;
  int64_t bytes = 0;  // the slot's size
  // Set when UpdateAdapter or UnloadAdapter begins: the attachment takes
  // part in no later version or bootstrap (it may still serve as a peer).
  mutable std::atomic<bool> retiring{false};
};

// The APPLY detail of an adapter's rank: its shares as fallback tensors
// (FallbackTensor.share unless whole), its staging region, its
// configuration.
void AdapterApply(const AdapterBinding& adapter, v1::ApplyDetail* apply);

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_ADAPTER_BINDING_H_
