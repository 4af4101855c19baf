// TransferExecutor: what carries out one instance's part of a version's
// transfer (a TransferJob). The VersionCoordinator's transfer worker calls
// Execute through it: LocalExecutor (local_executor.h) for jobs that stay
// on this node, RouteSender (route_sender.h) for jobs with ranks, sources
// or a replica on another node (RemoteExecutor::Handles says which).
//
// Owner: the Server owns the executors; the coordinator holds them, not
// owned. Threading: Execute may run on several transfer workers at once; a
// TransferJob and its progress belong to one call.
#ifndef FERRY_DAEMON_TRANSFER_TRANSFER_EXECUTOR_H_
#define FERRY_DAEMON_TRANSFER_TRANSFER_EXECUTOR_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/transfer/transfer_job.h"

namespace ferry {

class TransferExecutor {
 public:
  virtual ~TransferExecutor() = default;
  // Moves every byte of the job, updating job.progress (bytes_total first:
  // JobBytes) and, where the job asks, its APPLY details. CANCELLED when
  // job.progress->cancel was set.
  virtual absl::Status Execute(const TransferJob& job) = 0;
};

// Carries out jobs that reach another node (route_sender.h).
class RemoteExecutor : public TransferExecutor {
 public:
  // Whether the job's destination ranks, sources or replica are (some) on
  // another node.
  virtual bool Handles(const TransferJob& job) const = 0;
  // FP8 in flight, split tensors (core/fp8_sources.h): every block's max
  // |x| bits over the parts of `tensors` (indices into
  // job.plan->fp8->quantized()) that member `node` holds, a grid per
  // tensor (Peer.BlockAmax).
  virtual absl::StatusOr<std::vector<std::vector<uint32_t>>> PartialAmax(
      const TransferJob& job, const std::string& node,
      const std::vector<size_t>& tensors) = 0;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_TRANSFER_EXECUTOR_H_
