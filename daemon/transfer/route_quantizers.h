// FP8 in flight on a member (docs/architecture.md, "FP8 in flight"): the
// quantize step of the tensors whose trainer ranks are on a member.
//
// The coordinator plans every quantizer rank (Fp8Quantizer), but only the
// node that holds a tensor's trainer ranks can read them. So a route whose
// source is a member's quantizer rank carries, with its buckets, the
// tensors it reads and where their pieces are (RunTransferRequest.quantize,
// AddQuantizeOrder in quantize_order.h); the member (RouteQuantizers::Prepare) keeps the
// quantizer rank's buffers and quantizes each tensor once per version run
// before it packs the route, however many instances' routes name it.
//
// Threading: thread-safe:
// concurrent Prepares of one quantizer take turns (the second finds the
// tensors done), different quantizers run at once.
#ifndef FERRY_DAEMON_TRANSFER_ROUTE_QUANTIZERS_H_
#define FERRY_DAEMON_TRANSFER_ROUTE_QUANTIZERS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/fp8_sources.h"
#include "daemon/memory/gpu_reads.h"
#include "daemon/transfer/route_memory.h"
#include "transport/device_memory.h"
#include "proto/ferry/v1/peer.pb.h"

namespace ferry {

class RouteQuantizers {
 public:
  // `memory` (not owned): where the source ranks registered through this
  // daemon are, and where the quantizers' buffers are registered.
  // `devices` (not owned; may be null): reads ranks in GPU memory.
  RouteQuantizers(RouteMemory* memory, DeviceMemory* devices)
      : memory_(memory), devices_(devices) {}
  RouteQuantizers(const RouteQuantizers&) = delete;
  RouteQuantizers& operator=(const RouteQuantizers&) = delete;

  // Before a route reads quantizer `order.quantizer_id`: its buffers of
  // the order's sizes (made, or made anew when the sizes change, and
  // registered in RouteMemory as that participant's memory, dropped with
  // its source ranks), and every tensor of the order quantized into them
  // unless it already was for order.run. INVALID_ARGUMENT for an order
  // that is malformed (sizes past what the source ranks here could yield,
  // a tensor outside the buffers, a piece outside its rank's memory, a
  // tensor its pieces do not cover); FAILED_PRECONDITION for a piece of a
  // rank not registered here or in GPU memory; a rank's memory that went
  // away is reported as the data path reports it.
  absl::Status Prepare(const v1::QuantizeOrder& order)
      ABSL_LOCKS_EXCLUDED(mu_);

  // Peer.BlockAmax: every block's max |x| over the order's split tensors'
  // parts, read from the source ranks here (core/fp8_sources.h,
  // PartialAmax). Checked as Prepare checks an order; writes nothing.
  absl::StatusOr<v1::BlockAmaxResponse> BlockAmax(
      const v1::QuantizeOrder& order) ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Quantizer {
    absl::Mutex mu;
    // Held by RouteMemory (which drops it with its source ranks): expired
    // means made anew.
    std::weak_ptr<const MemoryMap> memory ABSL_GUARDED_BY(mu);
    std::map<int64_t, uint64_t> done ABSL_GUARDED_BY(mu);  // fp8_offset -> run
    // Host scratch for GPU ranks' pieces, grown to the largest tensor.
    std::unique_ptr<GpuReads> gpu_reads ABSL_GUARDED_BY(mu);
  };

  // An order parsed and checked: its tensors as a model and
  // QuantizedParams, a split tensor's combined max |x| bits (Prepare's)
  // and whether it writes the scales here, its pieces as source ranks
  // with their memory here (`on`, `bases`: null for GPU memory), and the
  // GPU bytes one tensor's read needs.
  struct Parsed {
    ModelSpec model;
    std::vector<QuantizedParam> quantized;
    std::vector<std::vector<uint32_t>> max_bits;
    std::vector<bool> scales_here;
    std::vector<RankLayout> sources;
    std::vector<std::shared_ptr<const MemoryMap>> maps;
    std::vector<const MemoryMap*> on;
    std::vector<std::vector<const uint8_t*>> bases;
    std::vector<std::string> ids;
    std::vector<std::vector<HeldPiece>> held;
    int64_t gpu_bytes = 0;
  };
  absl::Status Parse(const v1::QuantizeOrder& order, bool want_max_bits,
                     Parsed* out);
  std::shared_ptr<Quantizer> QuantizerOf(const std::string& id)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Its GpuReads, grown to `gpu_bytes` (null when 0).
  GpuReads* ReadsFor(Quantizer& quantizer, int64_t gpu_bytes)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(quantizer.mu);

  RouteMemory* const memory_;
  DeviceMemory* const devices_;
  absl::Mutex mu_;
  std::map<std::string, std::shared_ptr<Quantizer>> by_id_
      ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_ROUTE_QUANTIZERS_H_
