// MemberMemory: Lifecycle.Offload and Onload for destination ranks whose
// memory a member daemon maps, and the staging of LoRA adapter ranks whose
// engine ranks it maps (Lifecycle.LoadAdapter, adapters.h) (Peer.ManageMemory, docs/api.md "Offload and
// onload"). The coordinator runs the protocol and the ranks' events; the
// member, which holds the memory, takes the host copies (one per
// participant, host_copy.h), releases its maps, and writes the copies back
// into the memory the ranks registered again (Registry.UpdateRegions,
// which the member maps before forwarding it: forwarding.h).
//
// Also the coordinator's side of the call: PeerMemoryCaller.
//
// Owner: the Server. Threading: thread-safe (one mutex for the copies;
// copying runs outside it, one Peer call at a time per instance by the
// protocol).
#ifndef FERRY_DAEMON_MEMORY_MEMBER_MEMORY_H_
#define FERRY_DAEMON_MEMORY_MEMBER_MEMORY_H_

#include <functional>
#include <map>
#include <set>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/memory/host_copy.h"
#include "daemon/memory/memory_map.h"
#include "grpcpp/security/credentials.h"
#include "proto/ferry/v1/peer.pb.h"
#include "transport/device_memory.h"

namespace ferry {

class MemberMemory {
 public:
  // `local`: the memory a participant registered through this daemon holds
  // now (RouteMemory::LocalMemory), null if none. `devices` copies GPU
  // regions (may be null).
  using LocalMemoryOf =
      std::function<std::shared_ptr<const MemoryMap>(const std::string&)>;
  MemberMemory(LocalMemoryOf local, DeviceMemory* devices)
      : local_(std::move(local)), devices_(devices) {}

  // Where an adapter rank's staging is made the memory transfers write
  // (RouteMemory::AddLocal / RemoveLocal); unset: STAGE_ADAPTER is
  // FAILED_PRECONDITION.
  struct AdapterHooks {
    std::function<void(const std::string&, std::shared_ptr<const MemoryMap>)>
        add;
    std::function<void(const std::string&)> remove;
  };
  void set_adapter_hooks(AdapterHooks hooks) { hooks_ = std::move(hooks); }

  // One Peer.ManageMemory request: the bytes copied (COPY, RESTORE), the
  // region created (STAGE_ADAPTER).
  absl::StatusOr<v1::ManageMemoryResponse> Manage(
      const v1::ManageMemoryRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  // The participant left: its host copy, if any, goes, and so does the
  // staging of the adapters attached to it.
  void Forget(const std::string& participant_id) ABSL_LOCKS_EXCLUDED(mu_);
  // Host copies held now, bytes (for tests and logs).
  int64_t bytes() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  const LocalMemoryOf local_;
  DeviceMemory* const devices_;
  mutable absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<const HostCopy>> copies_
      ABSL_GUARDED_BY(mu_);
  AdapterHooks hooks_;  // set before serving
  // Adapter ranks' staging, by adapter rank id; and by engine rank id, the
  // adapter ranks attached to it.
  struct AdapterStaging;
  std::map<std::string, std::shared_ptr<AdapterStaging>> adapters_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::set<std::string>> adapters_of_
      ABSL_GUARDED_BY(mu_);
  absl::StatusOr<v1::ManageMemoryResponse> StageAdapter(
      const v1::ManageMemoryRequest& request) ABSL_LOCKS_EXCLUDED(mu_);
  void DropAdapter(const std::string& id) ABSL_LOCKS_EXCLUDED(mu_);
};

// The coordinator's call: Peer.ManageMemory on a member `node`; its
// answer. UNAVAILABLE naming the node when it is not a live member or
// cannot be reached.
using ManageRemoteMemory =
    std::function<absl::StatusOr<v1::ManageMemoryResponse>(
        const std::string& node, const v1::ManageMemoryRequest& request)>;
// `address_of` gives a live member's peer address ("" if none);
// `credentials` are this daemon's mutual-TLS credentials for peers;
// `timeout` bounds one call (a copy of a large model takes a while).
ManageRemoteMemory PeerMemoryCaller(
    std::function<std::string(const std::string&)> address_of,
    std::shared_ptr<grpc::ChannelCredentials> credentials,
    absl::Duration timeout);

}  // namespace ferry

#endif  // FERRY_DAEMON_MEMORY_MEMBER_MEMORY_H_
