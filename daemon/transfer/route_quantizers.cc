#include "daemon/transfer/route_quantizers.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/fp8_sources.h"
#include "core/fp8_split.h"
#include "core/fp8_targets.h"
#include "core/limits.h"
#include "core/parallel_for.h"
#include "core/validation.h"
#include "proto/convert.h"

namespace ferry {

namespace {

Dims DimsOf(const google::protobuf::RepeatedField<int64_t>& xs) {
  return Dims(xs.begin(), xs.end());
}

// What the quantize step of a member calls itself: the node of its
// order's tensors and parts.
constexpr char kHere[] = "this member";

// A split tensor's parts (QuantizeTensor.parts), each a 2-D box inside
// `shape` whose FP8 bytes lie inside buffer 0.
absl::Status PartsOf(const v1::QuantizeTensor& t, const Dims& shape,
                     int64_t fp8_bytes, QuantizedParam* q) {
  for (const v1::QuantizePart& p : t.parts()) {
    QuantizedPart part;
    part.node = kHere;
    part.box.offset = DimsOf(p.offset());
    part.box.extent = DimsOf(p.extent());
    part.fp8_offset = p.fp8_offset();
    int64_t bytes = 0;
    const Box& b = part.box;
    if (b.offset.size() != 2 || b.extent.size() != 2 || b.extent[0] <= 0 ||
        b.extent[1] <= 0 || b.offset[0] < 0 || b.offset[1] < 0 ||
        b.offset[0] > shape[0] - b.extent[0] ||
        b.offset[1] > shape[1] - b.extent[1] ||
        !CheckedMul(b.extent[0], b.extent[1], &bytes) ||
        part.fp8_offset < 0 || part.fp8_offset > fp8_bytes - bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a part ", BoxToString(b), " at byte ", part.fp8_offset,
          " is not a 2-D box of the tensor inside the quantizer's buffer 0"));
    }
    q->parts.push_back(std::move(part));
  }
  return absl::OkStatus();
}

// An order's tensors as a model and QuantizedParams (param i is tensor i),
// each checked: dtypes, 2-D shape, blocks, and its place in the buffers;
// a split tensor's parts, its combined max_bits when `want_max_bits` (the
// quantize step; not BlockAmax), and whether it writes the scales.
absl::Status TensorsOf(const v1::QuantizeOrder& order, bool want_max_bits,
                       ModelSpec* model, std::vector<QuantizedParam>* quantized,
                       std::vector<std::vector<uint32_t>>* max_bits,
                       std::vector<bool>* scales_here) {
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
    q.node = kHere;
    q.fp8_offset = t.fp8_offset();
    q.scale_offset = t.scale_offset();
    int64_t elements = 0;
    int64_t scales = 0;
    const int64_t grid_rows = (spec.shape[0] + q.block_rows - 1) / q.block_rows;
    const int64_t grid_cols = (spec.shape[1] + q.block_cols - 1) / q.block_cols;
    const bool split = t.parts_size() > 0;
    const bool writes_scales = !split || t.scales();
    if (!CheckedMul(spec.shape[0], spec.shape[1], &elements) ||
        !CheckedMul(grid_rows * 4, grid_cols, &scales) ||
        (!split && (q.fp8_offset < 0 ||
                    q.fp8_offset > order.fp8_bytes() - elements)) ||
        (writes_scales && (q.scale_offset < 0 ||
                           q.scale_offset > order.scale_bytes() - scales))) {
      return bad("outside the quantizer's buffers");
    }
    std::vector<uint32_t> bits;
    if (split) {
      absl::Status s = PartsOf(t, spec.shape, order.fp8_bytes(), &q);
      if (s.ok() && want_max_bits) {
        absl::StatusOr<std::vector<uint32_t>> b =
            UnpackMaxBits(t.max_bits(), scales / 4);
        s = b.status();
        if (b.ok()) bits = *std::move(b);
      }
      if (!s.ok()) return bad(std::string(s.message()));
    }
    model->params.push_back(std::move(spec));
    quantized->push_back(std::move(q));
    max_bits->push_back(std::move(bits));
    scales_here->push_back(writes_scales);
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
    // A split tensor's parts: each is the box of one of its pieces here,
    // so no more of them than of pieces (bounded above), and 2-D.
    if (t.parts_size() > t.pieces_size()) {
      return bad(absl::StrCat(Quote(t.parameter()), " has ", t.parts_size(),
                              " parts and ", t.pieces_size(),
                              " pieces (each part is a piece's box)"));
    }
    for (const v1::QuantizePart& p : t.parts()) {
      if (p.offset_size() != 2 || p.extent_size() != 2) {
        return bad(absl::StrCat("a part of ", Quote(t.parameter()), " of ",
                                p.offset_size(), " and ", p.extent_size(),
                                " dims (parts are 2-D)"));
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

absl::Status RouteQuantizers::Parse(const v1::QuantizeOrder& order,
                                    bool want_max_bits, Parsed* out) {
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
  s = TensorsOf(order, want_max_bits, &out->model, &out->quantized,
                &out->max_bits, &out->scales_here);
  if (!s.ok()) return s;
  s = SourcesOf(order, out->model, *memory_, &out->sources, &out->maps,
                &out->bases, &out->ids);
  if (!s.ok()) return s;
  out->held = HeldPieces(out->quantized, out->sources);
  // A piece in GPU memory is read through the host where there are GPUs.
  out->on.resize(out->maps.size());
  for (size_t r = 0; r < out->maps.size(); ++r) out->on[r] = out->maps[r].get();
  const bool gpus = devices_ != nullptr && devices_->Available().ok();
  const auto readable = [&](const HeldPiece& h) {
    const MemoryMap& m = *out->on[static_cast<size_t>(h.rank)];
    return h.piece->buffer < m.size() &&
           (!m.on_device(h.piece->buffer) || gpus);
  };
  for (size_t i = 0; i < out->quantized.size(); ++i) {
    const QuantizedParam& q = out->quantized[i];
    s = q.split() ? CheckPartsReadable(out->model, q, kHere, out->held[i],
                                       readable)
                  : CheckReadable(out->model, q, out->held[i], readable);
    if (!s.ok()) return s;
    out->gpu_bytes = std::max(
        out->gpu_bytes,
        GpuReads::GpuBytes(out->held[i], out->on, out->model.params[i].dtype));
  }
  return absl::OkStatus();
}

std::shared_ptr<RouteQuantizers::Quantizer> RouteQuantizers::QuantizerOf(
    const std::string& id) {
  // An entry is a few bytes once RouteMemory dropped its buffers, and
  // there is one per stream and node: kept.
  absl::MutexLock lock(&mu_);
  std::shared_ptr<Quantizer>& q = by_id_[id];
  if (q == nullptr) q = std::make_shared<Quantizer>();
  return q;
}

GpuReads* RouteQuantizers::ReadsFor(Quantizer& quantizer, int64_t gpu_bytes) {
  if (gpu_bytes <= 0) return nullptr;
  if (quantizer.gpu_reads == nullptr ||
      quantizer.gpu_reads->slot_bytes() < gpu_bytes) {
    quantizer.gpu_reads = std::make_unique<GpuReads>(devices_, gpu_bytes,
                                                     PlanningThreads());
  }
  return quantizer.gpu_reads.get();
}

absl::Status RouteQuantizers::Prepare(const v1::QuantizeOrder& order) {
  Parsed p;
  absl::Status s = Parse(order, /*want_max_bits=*/true, &p);
  if (!s.ok()) return s;
  std::shared_ptr<Quantizer> quantizer = QuantizerOf(order.quantizer_id());
  absl::MutexLock lock(&quantizer->mu);
  std::shared_ptr<const MemoryMap> out = quantizer->memory.lock();
  if (out == nullptr || out->bytes(0) != order.fp8_bytes() ||
      out->bytes(1) != order.scale_bytes()) {
    out = MemoryMap::OwnedHost({order.fp8_bytes(), order.scale_bytes()});
    memory_->AddDerived(order.quantizer_id(), out, p.ids);
    quantizer->memory = out;
    quantizer->done.clear();
  }
  GpuReads* reads = ReadsFor(*quantizer, p.gpu_bytes);
  // A tensor's key in `done`: where its (first part's) FP8 bytes start.
  const auto key = [&](size_t i) {
    const QuantizedParam& q = p.quantized[i];
    return q.split() ? q.parts[0].fp8_offset : q.fp8_offset;
  };
  std::vector<size_t> todo;
  for (size_t i = 0; i < p.quantized.size(); ++i) {
    auto it = quantizer->done.find(key(i));
    if (it == quantizer->done.end() || it->second != order.run()) {
      todo.push_back(i);
    }
  }
  std::vector<absl::Status> status(todo.size());
  ParallelFor(todo.size(), PlanningThreads(), [&](size_t k) {
    const size_t i = todo[k];
    const QuantizedParam& q = p.quantized[i];
    status[k] = RunOnHostPieces(
        reads, p.held[i], p.bases, p.on, p.model.params[q.param].dtype,
        [&](const std::vector<HeldPiece>& held,
            const std::vector<std::vector<const uint8_t*>>& bases) {
          if (!q.split()) {
            return QuantizeParam(p.model, q, held, bases, out->base(0),
                                 out->base(1));
          }
          return QuantizeParts(p.model, q, kHere, held, bases,
                               p.max_bits[i].data(), out->base(0),
                               p.scales_here[i] ? out->base(1) : nullptr);
        });
  });
  for (size_t k = 0; k < todo.size(); ++k) {
    if (!status[k].ok()) return status[k];
    quantizer->done[key(todo[k])] = order.run();
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::BlockAmaxResponse> RouteQuantizers::BlockAmax(
    const v1::QuantizeOrder& order) {
  Parsed p;
  absl::Status s = Parse(order, /*want_max_bits=*/false, &p);
  if (!s.ok()) return s;
  for (const QuantizedParam& q : p.quantized) {
    if (!q.split()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "BlockAmax of ", p.model.params[q.param].name,
          ": a tensor without parts (only split tensors combine amaxes)"));
    }
  }
  std::shared_ptr<Quantizer> quantizer = QuantizerOf(order.quantizer_id());
  absl::MutexLock lock(&quantizer->mu);
  GpuReads* reads = ReadsFor(*quantizer, p.gpu_bytes);
  std::vector<std::vector<uint32_t>> grids(p.quantized.size());
  std::vector<absl::Status> status(p.quantized.size());
  ParallelFor(p.quantized.size(), PlanningThreads(), [&](size_t i) {
    const QuantizedParam& q = p.quantized[i];
    const Dims& shape = p.model.params[q.param].shape;
    grids[i].assign((shape[0] + q.block_rows - 1) / q.block_rows *
                        ((shape[1] + q.block_cols - 1) / q.block_cols),
                    0u);
    status[i] = RunOnHostPieces(
        reads, p.held[i], p.bases, p.on, p.model.params[q.param].dtype,
        [&](const std::vector<HeldPiece>& held,
            const std::vector<std::vector<const uint8_t*>>& bases) {
          return PartialAmax(p.model, q, kHere, held, bases, grids[i].data());
        });
  });
  v1::BlockAmaxResponse response;
  for (size_t i = 0; i < grids.size(); ++i) {
    if (!status[i].ok()) return status[i];
    *response.add_max_bits() = PackMaxBits(grids[i]);
  }
  return response;
}

}  // namespace ferry
