// Lifecycle calls a controller makes on an instance (docs/api.md,
// "Bootstrap and reload", "Load options"): an RL controller, ferryctl, a
// test. Free functions over a Connection; each is one RPC with the
// connection's deadline unless given one. The rank-side call, SwapModel,
// is DestinationClient::SwapModel.
//
// Threading: any thread (gRPC stubs are thread-safe).
#ifndef FERRY_CLIENT_LIFECYCLE_CLIENT_H_
#define FERRY_CLIENT_LIFECYCLE_CLIENT_H_

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/connection.h"
#include "proto/ferry/v1/types.pb.h"

namespace ferry {

// Writes the stream's latest committed version into the instance again,
// from a peer instance; returns its status once settled (COMMITTED, or
// ABORTED with the reason: an outcome, not an error).
absl::StatusOr<v1::InstanceStatus> ReloadInPlace(
    const Connection& connection, const std::string& instance_id,
    absl::Duration timeout = absl::Minutes(2));

// Sets and clears load options; returns every option now in effect.
absl::StatusOr<std::map<std::string, std::string>> UpdateConfig(
    const Connection& connection, const std::string& instance_id,
    const std::map<std::string, std::string>& set,
    const std::vector<std::string>& clear = {});

// Lifecycle.Offload: the instance's ranks release their memory (after the
// daemon copied it, if `keep_host_copy`); returns its status once settled
// (OFFLOADED, or ABORTED with the reason).
absl::StatusOr<v1::InstanceStatus> Offload(
    const Connection& connection, const std::string& instance_id,
    bool keep_host_copy, absl::Duration timeout = absl::Minutes(2));

// Lifecycle.Onload: the ranks allocate again and are refilled (host copy,
// peer); returns COMMITTED, or ABORTED with dirty = true when the
// instance waits for the stream's next version.
absl::StatusOr<v1::InstanceStatus> Onload(
    const Connection& connection, const std::string& instance_id,
    absl::Duration timeout = absl::Minutes(2));

// Lifecycle.LoadAdapter: attaches the LoRA adapter whose tensors are the
// stream `adapter_stream` to the instance under `adapter_name`
// (docs/api.md, "LoRA adapters"); returns its status on that stream:
// COMMITTED when delivered now, IDLE (waiting_reason says why) when it
// waits for the stream's next version.
absl::StatusOr<v1::InstanceStatus> LoadAdapter(
    const Connection& connection, const std::string& instance_id,
    const std::string& adapter_name, const std::string& adapter_stream,
    const std::string& adapter_config_json,
    absl::Duration timeout = absl::Minutes(2));

// Lifecycle.UpdateAdapter: the name follows another stream and/or
// configuration (empty: keep the current one).
absl::StatusOr<v1::InstanceStatus> UpdateAdapter(
    const Connection& connection, const std::string& instance_id,
    const std::string& adapter_name, const std::string& adapter_stream,
    const std::string& adapter_config_json,
    absl::Duration timeout = absl::Minutes(2));

// Lifecycle.UnloadAdapter.
absl::Status UnloadAdapter(const Connection& connection,
                           const std::string& instance_id,
                           const std::string& adapter_name,
                           absl::Duration timeout = absl::Minutes(2));

// The options in effect (UpdateConfig with nothing to change).
absl::StatusOr<std::map<std::string, std::string>> GetConfig(
    const Connection& connection, const std::string& instance_id);

}  // namespace ferry

#endif  // FERRY_CLIENT_LIFECYCLE_CLIENT_H_
