// Turning a registration request into a Participant, in four steps, each
// done once (docs/architecture.md, "The registration walk"):
//   (a) limits on the wire message (proto/request_limits.h);
//   (b) one conversion of it to core/registration.h's struct
//       (proto/registration_convert.h);
//   (c) one check of that struct (core/registration_rules.h, the call the
//       C++ client makes too): INVALID_ARGUMENT naming the rank, the
//       parameter and the box (docs/api.md, "Error model");
//   (d) the regions checked for overlap and mapped (memory_map.h), and the
//       Participant built (here).
// Identity (id, token) and the checks that need the other participants
// (duplicate ranks, declarations that disagree) are the Registry's.
//
// Pure apart from mapping memory; any thread.
#ifndef FERRY_DAEMON_REGISTRY_REGISTRATION_PARSER_H_
#define FERRY_DAEMON_REGISTRY_REGISTRATION_PARSER_H_

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "daemon/registry/declaration_cache.h"
#include "daemon/registry/participant.h"
#include "proto/ferry/v1/registration.pb.h"

namespace ferry {

// `daemon_node`: this daemon's node name, which a registration's optional
// `node` must equal. `mapping.map_memory` false: the coordinator parsing a
// registration a member forwarded (MemoryMap::Map without mapping; the pid
// is not kept, pids mean nothing across nodes). `declarations` (null:
// none) holds declarations parsed before; the participant's `params` is
// then the held list.
absl::StatusOr<std::unique_ptr<Participant>> ParseSourceRegistration(
    const v1::SourceRegistration& source, absl::string_view daemon_node,
    const MapOptions& mapping, DeclarationCache* declarations = nullptr);

absl::StatusOr<std::unique_ptr<Participant>> ParseDestinationRegistration(
    const v1::DestinationRegistration& destination,
    absl::string_view daemon_node, const MapOptions& mapping);

// Registry.UpdateRegions: the regions `who` registered with `updated`
// replacing those of the same ids, checked and mapped again. Each updated
// id must be one registered, listed once, with the same size_bytes and the
// same kind of memory (shared memory or CUDA IPC); the rest keep their
// handles. INVALID_ARGUMENT naming the region otherwise; NOT_FOUND for an
// id never registered; MemoryMap::Map's errors.
struct RemappedRegions {
  std::unique_ptr<MemoryMap> memory;
  std::vector<v1::MemoryRegion> regions;  // all of them, as now registered
};
absl::StatusOr<RemappedRegions> RemapRegions(
    absl::string_view who, const std::vector<v1::MemoryRegion>& registered,
    const google::protobuf::RepeatedPtrField<v1::MemoryRegion>& updated,
    const MapOptions& mapping);

}  // namespace ferry

#endif  // FERRY_DAEMON_REGISTRY_REGISTRATION_PARSER_H_
