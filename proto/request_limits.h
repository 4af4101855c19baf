// Request limits: core/limits.h applied to the ferry.v1 requests where they
// enter ferryd, before any other work (docs/api.md, "Limits").
//
// Each check walks the request once, touches no daemon state and returns
// the first violation: INVALID_ARGUMENT for a malformed or absurd value (a
// name too long or with a forbidden character, too many dimensions, an
// extent or a tp_size / world_size past its limit), RESOURCE_EXHAUSTED for
// a legitimate kind of request that is too large (too many parameters,
// pieces, regions or fused parts). The message names the field as a path
// into the request ("source.pieces[3].box.extent[1]") and quotes user
// strings bounded (core/limits.h Quote).
//
// Pure; any thread.
#ifndef FERRY_PROTO_REQUEST_LIMITS_H_
#define FERRY_PROTO_REQUEST_LIMITS_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "proto/ferry/v1/inspection.pb.h"
#include "proto/ferry/v1/lifecycle.pb.h"
#include "proto/ferry/v1/peer.pb.h"
#include "proto/ferry/v1/registration.pb.h"
#include "proto/ferry/v1/types.pb.h"
#include "proto/ferry/v1/version.pb.h"

namespace ferry {

// Registrations: names, sizes, counts and shapes (`field` is the path of
// the message, "source" / "destination").
absl::Status CheckSourceLimits(const v1::SourceRegistration& source,
                               absl::string_view field = "source");
absl::Status CheckDestinationLimits(const v1::DestinationRegistration& d,
                                    absl::string_view field = "destination");

// A participant handle: id and token at most Limits::kMaxIdBytes each.
absl::Status CheckHandleLimits(const v1::ParticipantHandle& handle,
                               absl::string_view field = "handle");

// Lifecycle.UpdateConfig: at most Limits::kMaxConfigOptions keys set and
// cleared, each key and value at most Limits::kMaxNameBytes.
absl::Status CheckConfigLimits(const v1::UpdateConfigRequest& request);

// Lifecycle.LoadAdapter / UpdateAdapter: adapter_config_json at most
// Limits::kMaxAdapterConfigBytes.
absl::Status CheckAdapterConfigLimits(absl::string_view config_json);

// A free-text field that becomes part of an abort reason (AbortVersion's
// reason, a FAILED Ack's error_message): at most Limits::kMaxReasonBytes.
absl::Status CheckReasonLimits(absl::string_view field,
                               absl::string_view text);

// Versions.Ack: the handle, and the error_message as CheckReasonLimits
// bounds it.
absl::Status CheckAckLimits(const v1::AckRequest& request);

// Versions.AckBatch: 1 to Limits::kMaxAcksPerBatch acks (each is checked
// with CheckAckLimits on its own: one bad ack fails only itself).
absl::Status CheckAckBatchLimits(const v1::AckBatchRequest& request);

// Registry.HeartbeatBatch: 1 to Limits::kMaxHeartbeatsPerBatch heartbeats
// (each handle is checked with CheckHandleLimits on its own).
absl::Status CheckHeartbeatBatchLimits(
    const v1::HeartbeatBatchRequest& request);

// One Versions.SubscribeRelay message: opens plus closes at most
// Limits::kMaxRelayChangesPerMessage; each open's id > 0 and its handle
// within CheckHandleLimits.
absl::Status CheckSubscribeRelayLimits(
    const v1::SubscribeRelayRequest& request);

// A name field that may be empty (filters, optional checks); when set, a
// valid name (proto/convert.h ValidateName).
absl::Status CheckOptionalName(absl::string_view field,
                               absl::string_view value);

// Registry.UpdateRegions: the handle, and the regions as a registration's
// (at most Limits::kMaxRegionsPerRegistration, names and handles bounded).
absl::Status CheckUpdateRegionsLimits(const v1::UpdateRegionsRequest& request);

// Peer.ManageMemory: at most Limits::kMaxParticipantsPerDaemon participant
// ids, each at most Limits::kMaxIdBytes.
absl::Status CheckManageMemoryLimits(const v1::ManageMemoryRequest& request);

// Peer.HashBoxes: at most Limits::kMaxBoxesPerHashCall boxes, each naming
// a bounded participant id and at most Limits::kMaxDims dimensions.
absl::Status CheckHashBoxesLimits(const v1::HashBoxesRequest& request);

}  // namespace ferry

#endif  // FERRY_PROTO_REQUEST_LIMITS_H_
