// The steps that make one adapter rank beside an engine rank
// (Adapters::BuildRanksLocked, adapters.h): the rank's shares of the adapter
// laid out in one staging slot, the slot made (here, or by the member
// whose node holds the engine rank) and mapped.
//
// Owner: none (free functions). Threading: any thread; Adapters calls them
// under its lock.
#ifndef FERRY_DAEMON_LIFECYCLE_ADAPTER_RANKS_H_
#define FERRY_DAEMON_LIFECYCLE_ADAPTER_RANKS_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/adapter_shares.h"
#include "core/model_spec.h"
#include "daemon/memory/member_memory.h"
#include "daemon/memory/memory_map.h"
#include "daemon/registry/adapter_binding.h"
#include "daemon/registry/participant.h"

namespace ferry {

// Lays out one rank's `shares` (of the adapter's `tensors`) in its staging
// slot, each aligned so that an engine can view it as a tensor, in the
// adapter's tensor order: the binding's shares and bytes, and the rank's
// pieces.
void LayOutAdapterShares(const std::vector<AdapterShare>& shares,
                         const std::vector<ParamSpec>& tensors,
                         AdapterBinding* binding, Participant* p);

// Makes the rank's staging of binding->bytes: on the member whose node
// holds `engine` when `on_member` (through `remote_memory`, under
// `rank_id`), else here (a StagingArea named `staging_name`);
// binding->exported names it. Errors start with `who_rank`.
absl::Status MakeAdapterStaging(const ManageRemoteMemory& remote_memory,
                                bool on_member, const Participant& engine,
                                const std::string& rank_id,
                                const std::string& staging_name,
                                const std::string& who_rank,
                                AdapterBinding* binding);

// Makes `p` the adapter rank: a destination of `adapter_stream` in
// `instance`, in `engine`'s place, holding `binding`, over a map of the
// binding's staging (the daemon writes the shares through it, as it writes
// an engine's registered memory; `map_options` says whether it is mapped
// here).
absl::Status MapAdapterRank(const Participant& engine,
                            const std::string& adapter_stream,
                            const std::string& instance, const std::string& who,
                            const MapOptions& map_options,
                            std::shared_ptr<AdapterBinding> binding,
                            Participant* p);

}  // namespace ferry

#endif  // FERRY_DAEMON_LIFECYCLE_ADAPTER_RANKS_H_
