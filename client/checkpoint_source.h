// A checkpoint file as the source of a version (seed 004: reload weights in
// place from disk): the checkpoint's files are registered with ferryd as
// read-only source memory, as they are (MemoryRegion file_path: the daemon
// maps the same file; no copy), the stream's only source rank, and one
// version is published into every instance that follows the stream, with
// the same PREPARE / PAUSE / APPLY / COMMIT guarantees as a trainer's
// version. GGUF tensor names become the Hugging Face names engines declare
// (checkpoint/tp_split.h HfNameOfGguf).
//
// The stream must have no other source registered (a trainer's ranks):
// the registration is refused otherwise, and nothing begins.
#ifndef FERRY_CLIENT_CHECKPOINT_SOURCE_H_
#define FERRY_CLIENT_CHECKPOINT_SOURCE_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "checkpoint/checkpoint.h"
#include "client/connection.h"
#include "client/source_client.h"

namespace ferry {

struct CheckpointPublishOptions {
  std::string stream;    // required
  int64_t version = 0;   // 0: the stream's latest committed version + 1
  // Wait at most this long for the stream's instances to be complete
  // (every TP rank registered) before beginning; zero: do not wait.
  absl::Duration wait_for_instances = absl::ZeroDuration();
};

// The checkpoint as a source layout: one parameter and one whole-tensor
// piece per tensor (region id = file index), regions naming the files.
absl::StatusOr<SourceLayout> CheckpointSourceLayout(const Checkpoint& c);

// Registers, publishes the version, deregisters. The outcome is the
// version's (instances COMMITTED or ABORTED with their reasons).
absl::StatusOr<PublishOutcome> PublishCheckpoint(
    const Connection& connection, const Checkpoint& checkpoint,
    const CheckpointPublishOptions& options);

}  // namespace ferry

#endif  // FERRY_CLIENT_CHECKPOINT_SOURCE_H_
