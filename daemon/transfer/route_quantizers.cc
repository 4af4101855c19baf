#include "daemon/transfer/route_quantizers.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/fp8_sources.h"
#include "core/fp8_targets.h"
#include "core/limits.h"
#include "core/parallel_for.h"
#include "core/validation.h"
#include "proto/convert.h"
#include "transport/memory_fault_guard.h"

namespace ferry {

namespace {

Dims DimsOf(const google::protobuf::RepeatedField<int64_t>& xs) {
  return Dims(xs.begin(), xs.end());
}

// An order's tensors as a model and QuantizedParams (param i is tensor i),
// each checked: dtypes, 2-D shape, blocks, and its place in the buffers.
absl::Status TensorsOf(const v1::QuantizeOrder& order, ModelSpec* model,
                       std::vector<QuantizedParam>* quantized) {
  for (const v1::QuantizeTensor& t : order.tensors()) {
    ParamSpec spec;
    spec.name = t.parameter();
    spec.shape = DimsOf(t.shape());
    absl::StatusOr<DType> dtype = DTypeFromProto(t.dtype(), spec.name);
    absl::StatusOr<DType> format = DTypeFromProto(t.format(), spec.name);
    const auto bad = [&](const std::string& why) {
      return absl::InvalidArgumentError(absl::StrCat(
          "quantize order of ", order.quantizer_id(), ": ", spec.name, ": ",
          why));
    };
    if (!dtype.ok() || !IsFp8Source(*dtype)) return bad("dtype not bf16/f16/f32");
    if (!format.ok() || !IsFp8Format(*format)) return bad("format not e4m3/e5m2");
    if (spec.shape.size() != 2 || spec.shape[0] <= 0 || spec.shape[1] <= 0 ||
        spec.shape[0] > Limits::kMaxExtent ||
        spec.shape[1] > Limits::kMaxExtent) {
      return bad("not a 2-D shape in bounds");
    }
    if (t.block_rows() <= 0 || t.block_cols() <= 0 ||
        t.block_rows() > Limits::kMaxExtent ||
        t.block_cols() > Limits::kMaxExtent) {
      return bad("block size out of range");
    }
    spec.dtype = *dtype;
    QuantizedParam q;
    q.param = static_cast<int32_t>(model->params.size());
    q.format = *format;
    q.block_rows = t.block_rows();
    q.block_cols = t.block_cols();
    q.node = "this member";
    q.fp8_offset = t.fp8_offset();
    q.scale_offset = t.scale_offset();
    int64_t elements = 0;
    int64_t scales = 0;
    const int64_t grid_rows = (spec.shape[0] + q.block_rows - 1) / q.block_rows;
    const int64_t grid_cols = (spec.shape[1] + q.block_cols - 1) / q.block_cols;
    if (!CheckedMul(spec.shape[0], spec.shape[1], &elements) ||
        !CheckedMul(grid_rows * 4, grid_cols, &scales) || q.fp8_offset < 0 ||
        q.scale_offset < 0 || q.fp8_offset > order.fp8_bytes() - elements ||
        q.scale_offset > order.scale_bytes() - scales) {
      return bad("outside the quantizer's buffers");
    }
    model->params.push_back(std::move(spec));
    quantized->push_back(std::move(q));
  }
  model->BuildIndex();
  return ValidateModelSpec(*model);
}

// The order's pieces as source ranks (one per participant id, in order of
// first use) over `model`, each checked against its memory here; `maps`
// and `bases` (null: GPU memory) by rank.
absl::Status SourcesOf(const v1::QuantizeOrder& order, const ModelSpec& model,
                       RouteMemory& memory, std::vector<RankLayout>* sources,
                       std::vector<std::shared_ptr<const MemoryMap>>* maps,
                       std::vector<std::vector<const uint8_t*>>* bases,
                       std::vector<std::string>* ids) {
  std::map<std::string, size_t> rank_of;
  for (int i = 0; i < order.tensors_size(); ++i) {
    for (const v1::HeldBox& b : order.tensors(i).pieces()) {
      auto [it, fresh] = rank_of.try_emplace(b.participant_id(), ids->size());
      if (fresh) {
        std::shared_ptr<const MemoryMap> m =
            memory.LocalMemory(b.participant_id());
        if (m == nullptr || !m->mapped() || m->released()) {
          return absl::FailedPreconditionError(absl::StrCat(
              "quantize order of ", order.quantizer_id(), ": source rank ",
              b.participant_id(), " is not registered through this daemon"));
        }
        ids->push_back(b.participant_id());
        RankLayout layout;
        layout.rank = static_cast<int32_t>(sources->size());
        layout.buffer_bytes = m->sizes();
        sources->push_back(std::move(layout));
        bases->emplace_back();
        for (size_t k = 0; k < m->size(); ++k) {
          bases->back().push_back(m->on_device(k) ? nullptr : m->base(k));
        }
        maps->push_back(std::move(m));
      }
      Piece p;
      p.param = i;
      p.buffer = b.buffer();
      p.byte_offset = b.byte_offset();
      p.box.offset = DimsOf(b.offset());
      p.box.extent = DimsOf(b.extent());
      p.strides = DimsOf(b.strides());
      (*sources)[it->second].pieces.push_back(std::move(p));
    }
  }
  for (size_t r = 0; r < sources->size(); ++r) {
    absl::Status s = ValidateRankPieces(
        model, (*sources)[r], absl::StrCat("source rank ", (*ids)[r]),
        /*allow_staging=*/false);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

// The order's counts and sizes within ferryd's limits (core/limits.h),
// before any work: tensors and pieces as many as one registration may
// declare, names and ids as long, boxes of at most kMaxDims dims.
absl::Status CheckBounds(const v1::QuantizeOrder& order) {
  const auto bad = [&](const std::string& what) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantize order of ", Quote(order.quantizer_id()), ": ",
                     what));
  };
  if (order.tensors_size() > Limits::kMaxEngineParamsPerRegistration) {
    return bad(absl::StrCat(order.tensors_size(), " tensors (at most ",
                            Limits::kMaxEngineParamsPerRegistration, ")"));
  }
  int64_t pieces = 0;
  for (const v1::QuantizeTensor& t : order.tensors()) {
    if (t.parameter().size() > Limits::kMaxParameterNameBytes ||
        t.shape_size() > static_cast<int>(Limits::kMaxDims)) {
      return bad(absl::StrCat("a tensor's name of ", t.parameter().size(),
                              " bytes or ", t.shape_size(), " dims (at most ",
                              Limits::kMaxParameterNameBytes, " and ",
                              Limits::kMaxDims, ")"));
    }
    pieces += t.pieces_size();
    for (const v1::HeldBox& b : t.pieces()) {
      const size_t dims = Limits::kMaxDims;
      if (b.participant_id().size() > Limits::kMaxIdBytes ||
          static_cast<size_t>(b.offset_size()) > dims ||
          static_cast<size_t>(b.extent_size()) > dims ||
          static_cast<size_t>(b.strides_size()) > dims) {
        return bad(absl::StrCat("a piece of ", Quote(t.parameter()),
                                " with an id past ", Limits::kMaxIdBytes,
                                " bytes or more than ", dims, " dims"));
      }
    }
  }
  if (pieces > Limits::kMaxPiecesPerRegistration) {
    return bad(absl::StrCat(pieces, " pieces (at most ",
                            Limits::kMaxPiecesPerRegistration, ")"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RouteQuantizers::Prepare(const v1::QuantizeOrder& order) {
  const int64_t local = memory_->LocalBytes();
  if (order.quantizer_id().empty() ||
      order.quantizer_id().size() > Limits::kMaxIdBytes ||
      order.fp8_bytes() < 0 || order.scale_bytes() < 0 ||
      order.fp8_bytes() > local || order.scale_bytes() > 2 * local) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantize order: a quantizer id of 1 to ", Limits::kMaxIdBytes,
        " bytes and buffers of at most the source ranks' ", local,
        " bytes here (scales twice that) are required"));
  }
  absl::Status s = CheckBounds(order);
  if (!s.ok()) return s;
  ModelSpec model;
  std::vector<QuantizedParam> quantized;
  s = TensorsOf(order, &model, &quantized);
  if (!s.ok()) return s;
  std::vector<RankLayout> sources;
  std::vector<std::shared_ptr<const MemoryMap>> maps;
  std::vector<std::vector<const uint8_t*>> bases;
  std::vector<std::string> ids;
  s = SourcesOf(order, model, *memory_, &sources, &maps, &bases, &ids);
  if (!s.ok()) return s;
  const std::vector<std::vector<HeldPiece>> held =
      HeldPieces(quantized, sources);
  // A piece in GPU memory is read through the host where there are GPUs.
  std::vector<const MemoryMap*> on(maps.size());
  for (size_t r = 0; r < maps.size(); ++r) on[r] = maps[r].get();
  const bool gpus = devices_ != nullptr && devices_->Available().ok();
  int64_t gpu_bytes = 0;
  for (size_t i = 0; i < quantized.size(); ++i) {
    s = CheckReadable(model, quantized[i], held[i], [&](const HeldPiece& h) {
      const MemoryMap& m = *on[static_cast<size_t>(h.rank)];
      return h.piece->buffer < m.size() &&
             (!m.on_device(h.piece->buffer) || gpus);
    });
    if (!s.ok()) return s;
    gpu_bytes = std::max(gpu_bytes,
                         GpuReads::GpuBytes(held[i], on,
                                            model.params[i].dtype));
  }

  std::shared_ptr<Quantizer> quantizer;
  {
    // An entry is a few bytes once RouteMemory dropped its buffers, and
    // there is one per stream and node: kept.
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Quantizer>& q = by_id_[order.quantizer_id()];
    if (q == nullptr) q = std::make_shared<Quantizer>();
    quantizer = q;
  }
  absl::MutexLock lock(&quantizer->mu);
  std::shared_ptr<const MemoryMap> out = quantizer->memory.lock();
  if (out == nullptr || out->bytes(0) != order.fp8_bytes() ||
      out->bytes(1) != order.scale_bytes()) {
    out = MemoryMap::OwnedHost({order.fp8_bytes(), order.scale_bytes()});
    memory_->AddDerived(order.quantizer_id(), out, ids);
    quantizer->memory = out;
    quantizer->done.clear();
  }
  if (gpu_bytes > 0 && (quantizer->gpu_reads == nullptr ||
                        quantizer->gpu_reads->slot_bytes() < gpu_bytes)) {
    quantizer->gpu_reads = std::make_unique<GpuReads>(
        devices_, gpu_bytes, PlanningThreads());
  }
  GpuReads* reads = gpu_bytes > 0 ? quantizer->gpu_reads.get() : nullptr;
  std::vector<size_t> todo;
  for (size_t i = 0; i < quantized.size(); ++i) {
    auto it = quantizer->done.find(quantized[i].fp8_offset);
    if (it == quantizer->done.end() || it->second != order.run()) {
      todo.push_back(i);
    }
  }
  std::vector<absl::Status> status(todo.size());
  ParallelFor(todo.size(), PlanningThreads(), [&](size_t k) {
    const QuantizedParam& q = quantized[todo[k]];
    std::unique_ptr<GpuReads::Host> host;
    if (reads != nullptr) {
      absl::StatusOr<std::unique_ptr<GpuReads::Host>> read = reads->Read(
          held[todo[k]], bases, on, model.params[q.param].dtype);
      if (!read.ok()) {
        status[k] = read.status();
        return;
      }
      host = *std::move(read);
    }
    absl::Status guarded = RunGuarded([&] {
      status[k] = host != nullptr
                      ? QuantizeParam(model, q, host->held(), host->bases(),
                                      out->base(0), out->base(1))
                      : QuantizeParam(model, q, held[todo[k]], bases,
                                      out->base(0), out->base(1));
    });
    if (!guarded.ok()) status[k] = NameMemoryFault(guarded);
  });
  for (size_t k = 0; k < todo.size(); ++k) {
    if (!status[k].ok()) return status[k];
    quantizer->done[quantized[todo[k]].fp8_offset] = order.run();
  }
  return absl::OkStatus();
}

}  // namespace ferry
