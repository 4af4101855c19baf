// VersionCoordinatorOptions: the settings of a VersionCoordinator
// (version_coordinator.h; VersionCoordinator::Options), from ferryd's flags
// (daemon/daemon_options.h) or a test's choices. Plain data, copied in at
// construction.
#ifndef FERRY_DAEMON_VERSIONS_COORDINATOR_OPTIONS_H_
#define FERRY_DAEMON_VERSIONS_COORDINATOR_OPTIONS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/time/time.h"
#include "common/clock.h"
#include "transport/device_memory.h"

namespace ferry {

struct VersionCoordinatorOptions {
  absl::Duration ack_timeout = absl::Seconds(30);
  absl::Duration version_timeout = absl::Minutes(2);
  size_t history = 16;  // settled versions kept per stream
  // How long a paused replica waits for the replica it relays from to
  // finish pausing (after that it reads the trainer). A replica that is
  // paused or transferring is always waited for.
  absl::Duration relay_wait = absl::Seconds(2);
  // Pins the fallback staging of ranks that registered GPU memory, so
  // the GPU engines write it (staging_area.h). Not owned; null: never.
  DeviceMemory* devices = nullptr;
  // Staging all instances together may hold, bytes (docs/api.md,
  // "Limits"). An instance whose fallback tensors would take more aborts
  // its version, clean, with a RESOURCE_EXHAUSTED reason naming it and
  // the bytes. Negative: half the size of /dev/shm, measured when the
  // coordinator is built.
  int64_t max_staging_bytes = -1;
  // A GPU rank that asks for device staging (StagingPlacement DEVICE)
  // gets it; false: every rank's staging is host memory.
  bool device_staging = true;
  // This daemon's node. Staging is reserved here only for ranks on it: a
  // member reserves its own ranks' staging when it receives their
  // transfer (remote_receiver.cc), under its own limit. Empty: every rank
  // (tests of one node that do not name it).
  std::string node;
  // Where ack and version deadlines read the time (clock.h). Not owned;
  // null: the real clock.
  const Clock* clock = nullptr;
  // Instances whose transfers run at once, each on a transfer worker of
  // its own: the replicas of a version land side by side, bounded by
  // their own routes, not one after another. 1: one at a time.
  int transfer_workers = 8;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_VERSIONS_COORDINATOR_OPTIONS_H_
