// The quantize order of a route (RunTransferRequest.quantize): what a
// member quantizes before it sends a route that reads its quantizer rank
// (FP8 in flight; the member's side is route_quantizers.h). Part of
// building routes (transfer_routes.h). Pure; any thread.
#ifndef FERRY_DAEMON_TRANSFER_QUANTIZE_ORDER_H_
#define FERRY_DAEMON_TRANSFER_QUANTIZE_ORDER_H_

#include <cstddef>
#include <cstdint>
#include <set>
#include <vector>

#include "daemon/plans/fp8_quantizer.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/participant.h"
#include "daemon/transfer/transfer_job.h"
#include "proto/ferry/v1/peer.pb.h"

namespace ferry {

// The order's `run` for version run `run` (VersionRun::serial): unique
// across this process's restarts too (a random incarnation mixed in), so
// that a member never takes a run of a restarted coordinator for one it
// already quantized.
uint64_t QuantizeRunKey(uint64_t run);

// Coordinator: the quantize order of member quantizer rank `quantizer`
// for `tensors` (indices into plan.fp8->quantized()) in version run
// `run`: their shapes, blocks, places in the quantizer's buffers, their
// pieces in the trainer ranks on the quantizer's node, and for a split
// tensor its parts there, whether the quantizer keeps its scales and,
// where `combined` is not null, every block's max |x| combined over all
// holders (Fp8Quantizer::CombinedAmax).
v1::QuantizeOrder QuantizeOrderOf(const StreamPlan& plan,
                                  const Participant& quantizer,
                                  const std::set<size_t>& tensors,
                                  uint64_t run,
                                  const Fp8Quantizer::Combined* combined);

// `req`'s quantize order for a route of `job` that reads member quantizer
// rank `quantizer` for `tensors`, with the run's combined amaxes.
void AddQuantizeOrder(const TransferJob& job, const Participant& quantizer,
                      const std::set<size_t>& tensors,
                      v1::RunTransferRequest* req);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_QUANTIZE_ORDER_H_
