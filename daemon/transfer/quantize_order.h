// The quantize order of a route (RunTransferRequest.quantize): what a
// member quantizes before it sends a route that reads its quantizer rank
// (FP8 in flight; the member's side is route_quantizers.h). Part of
// building routes (transfer_routes.h). Pure; any thread.
#ifndef FERRY_DAEMON_TRANSFER_QUANTIZE_ORDER_H_
#define FERRY_DAEMON_TRANSFER_QUANTIZE_ORDER_H_

#include <cstddef>
#include <cstdint>
#include <set>

#include "daemon/registry/participant.h"
#include "daemon/transfer/transfer_job.h"
#include "proto/ferry/v1/peer.pb.h"

namespace ferry {

// The order's `run` for version run `run` (VersionRun::serial): unique
// across this process's restarts too (a random incarnation mixed in), so
// that a member never takes a run of a restarted coordinator for one it
// already quantized.
uint64_t QuantizeRunKey(uint64_t run);

// Coordinator: `req`'s quantize order for a route that reads member
// quantizer rank `quantizer` for `tensors` (indices into
// job.plan->fp8->quantized()): their shapes, blocks, places in the
// quantizer's buffers, and their pieces in the trainer ranks on the
// quantizer's node.
void AddQuantizeOrder(const TransferJob& job, const Participant& quantizer,
                      const std::set<size_t>& tensors,
                      v1::RunTransferRequest* req);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_QUANTIZE_ORDER_H_
