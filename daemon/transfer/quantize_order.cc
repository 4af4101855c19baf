#include "daemon/transfer/quantize_order.h"

#include <random>

#include "core/fp8_sources.h"
#include "daemon/plans/fp8_quantizer.h"
#include "proto/convert.h"

namespace ferry {

uint64_t QuantizeRunKey(uint64_t run) {
  // Drawn once per process: a coordinator that restarts numbers its runs
  // from 1 again, and a member must not take a new run for one it
  // quantized for the old coordinator.
  static const uint64_t incarnation = [] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }();
  return incarnation ^ (run * 0x9E3779B97F4A7C15ull);
}

void AddQuantizeOrder(const TransferJob& job, const Participant& quantizer,
                      const std::set<size_t>& tensors,
                      v1::RunTransferRequest* req) {
  const StreamPlan& sp = *job.plan;
  const Fp8Quantizer& fp8 = *sp.fp8;
  v1::QuantizeOrder* order = req->mutable_quantize();
  order->set_quantizer_id(quantizer.id);
  order->set_run(QuantizeRunKey(job.run));
  order->set_fp8_bytes(quantizer.memory->bytes(0));
  order->set_scale_bytes(quantizer.memory->bytes(1));
  for (size_t i : tensors) {
    const QuantizedParam& q = fp8.quantized()[i];
    const ParamSpec& spec = sp.model.params[q.param];
    v1::QuantizeTensor* t = order->add_tensors();
    t->set_parameter(spec.name);
    t->set_dtype(DTypeToProto(spec.dtype));
    for (int64_t d : spec.shape) t->add_shape(d);
    t->set_format(DTypeToProto(q.format));
    t->set_block_rows(q.block_rows);
    t->set_block_cols(q.block_cols);
    t->set_fp8_offset(q.fp8_offset);
    t->set_scale_offset(q.scale_offset);
    // The pieces on the quantizer's node (they cover the tensor:
    // CheckHeldOnNode); replicas elsewhere are not read.
    for (const HeldPiece& h : fp8.held(i)) {
      const Participant* rank = sp.sources[h.rank].get();
      if (rank == nullptr || rank->node != quantizer.node) continue;
      v1::HeldBox* b = t->add_pieces();
      b->set_participant_id(rank->id);
      b->set_buffer(h.piece->buffer);
      b->set_byte_offset(h.piece->byte_offset);
      for (int64_t x : h.piece->box.offset) b->add_offset(x);
      for (int64_t x : h.piece->box.extent) b->add_extent(x);
      for (int64_t x : h.piece->strides) b->add_strides(x);
    }
  }
}

}  // namespace ferry
