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

v1::QuantizeOrder QuantizeOrderOf(const StreamPlan& sp,
                                  const Participant& quantizer,
                                  const std::set<size_t>& tensors,
                                  uint64_t run,
                                  const Fp8Quantizer::Combined* combined) {
  const Fp8Quantizer& fp8 = *sp.fp8;
  v1::QuantizeOrder order;
  order.set_quantizer_id(quantizer.id);
  order.set_run(QuantizeRunKey(run));
  order.set_fp8_bytes(quantizer.memory->bytes(0));
  order.set_scale_bytes(quantizer.memory->bytes(1));
  for (size_t i : tensors) {
    const QuantizedParam& q = fp8.quantized()[i];
    const ParamSpec& spec = sp.model.params[q.param];
    v1::QuantizeTensor* t = order.add_tensors();
    t->set_parameter(spec.name);
    t->set_dtype(DTypeToProto(spec.dtype));
    for (int64_t d : spec.shape) t->add_shape(d);
    t->set_format(DTypeToProto(q.format));
    t->set_block_rows(q.block_rows);
    t->set_block_cols(q.block_cols);
    t->set_fp8_offset(q.fp8_offset);
    t->set_scale_offset(q.scale_offset);
    if (q.split()) {
      for (const QuantizedPart& part : q.parts) {
        if (part.node != quantizer.node) continue;
        v1::QuantizePart* p = t->add_parts();
        for (int64_t x : part.box.offset) p->add_offset(x);
        for (int64_t x : part.box.extent) p->add_extent(x);
        p->set_fp8_offset(part.fp8_offset);
      }
      t->set_scales(q.node == quantizer.node);
      if (combined != nullptr && i < combined->packed.size()) {
        t->set_max_bits(combined->packed[i]);
      }
    }
    // The pieces on the quantizer's node (they cover the tensor, or its
    // parts there); replicas elsewhere are not read.
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
  return order;
}

void AddQuantizeOrder(const TransferJob& job, const Participant& quantizer,
                      const std::set<size_t>& tensors,
                      v1::RunTransferRequest* req) {
  const std::shared_ptr<const Fp8Quantizer::Combined> combined =
      job.plan->fp8->CombinedAmax(job.run);
  *req->mutable_quantize() = QuantizeOrderOf(*job.plan, quantizer, tensors,
                                             job.run, combined.get());
}

}  // namespace ferry
