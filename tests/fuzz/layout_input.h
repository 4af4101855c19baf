// The first half of layout_resolution_fuzzer's input: a model and the engine
// tables of one instance, built from a FuzzedDataProvider. Shared with
// make_seeds.cc, which keeps inputs whose tables resolve in each way there is
// (direct, fused, vocab, fallbacks) as seeds.
//
// The model has up to 8 checkpoint parameters drawn from a small vocabulary
// of names (so that engine tables name them); the instance has 1 to 4 TP
// ranks whose tables usually share one template, as a real engine's do, with
// per-rank deviations. Shapes, offsets and buffers are usually consistent
// with the model (so that direct and fused resolutions happen) and
// sometimes raw 64-bit values.
#ifndef FERRY_TESTS_FUZZ_LAYOUT_INPUT_H_
#define FERRY_TESTS_FUZZ_LAYOUT_INPUT_H_

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/checked_math.h"
#include "core/layout_resolution.h"
#include "core/piece.h"

namespace ferry {
namespace fuzz {

// Checkpoint names [0, 8); engine-only names after.
inline const char* const kNames[] = {
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.experts.0.w1.weight",
    "model.layers.0.mlp.experts.1.w1.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.experts.w13_weight",
    "lm_head.weight",
};
constexpr int kCheckpointNames = 8;
constexpr int kAllNames = sizeof(kNames) / sizeof(kNames[0]);

inline int64_t Dim(FuzzedDataProvider& in) {
  static const int64_t kDims[] = {0,  1,  2,  3,   4,   6,    8,    12,
                                  16, 32, 64, 128, 256, 1024, 4096, -1};
  const int64_t d = kDims[in.ConsumeIntegralInRange<int>(0, 15)];
  return d >= 0 ? d : in.ConsumeIntegral<int64_t>();
}

inline Dims Shape(FuzzedDataProvider& in, int max_rank) {
  Dims out;
  const int rank = in.ConsumeIntegralInRange<int>(0, max_rank);
  for (int i = 0; i < rank; ++i) out.push_back(Dim(in));
  return out;
}

inline DType PickDType(FuzzedDataProvider& in) {
  if (in.ConsumeIntegralInRange<int>(0, 31) == 0) {
    return static_cast<DType>(in.ConsumeIntegral<uint8_t>());  // any number
  }
  // Mostly plain types, so that shapes need not be whole blocks.
  if (in.ConsumeBool()) return DType::kBF16;
  return static_cast<DType>(in.ConsumeIntegralInRange<int>(1, 20));
}

// Bytes of a contiguous tensor, or -1.
inline int64_t TensorBytes(const Dims& shape, DType dtype) {
  const auto id = static_cast<uint8_t>(dtype);
  if (id == 0 || id > static_cast<uint8_t>(DType::kQ6_K)) return -1;
  int64_t units = 1;
  const int64_t block = BlockElems(dtype);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] < 0) return -1;
    int64_t d = shape[i];
    if (i + 1 == shape.size()) d = d / block + (d % block != 0);
    if (!CheckedMul(units, d, &units)) return -1;
  }
  int64_t bytes;
  return CheckedMul(units, UnitBytes(dtype), &bytes) ? bytes : -1;
}

inline int64_t PerRank(int64_t extent, int32_t tp) {
  if (tp <= 0) return extent;
  return extent / tp + (extent % tp != 0);
}

// a + b, or a when that overflows (the harness never overflows on its own).
inline int64_t Plus(int64_t a, int64_t b) {
  int64_t out;
  return CheckedAdd(a, b, &out) ? out : a;
}

// A live shape that fits the loader (so that direct resolutions happen),
// from the checkpoint parameter(s) it names.
inline Dims DerivedShape(const ModelSpec& model, const EngineParam& p, int32_t tp) {
  auto find = [&](const std::string& name) -> const ParamSpec* {
    const int32_t id = model.Find(name);
    return id < 0 ? nullptr : &model.params[id];
  };
  if (p.loader == LoaderKind::kFused && !p.parts.empty()) {
    const ParamSpec* first = find(p.parts[0].checkpoint_name);
    if (first == nullptr) return {};
    Dims local = first->shape;
    const size_t d = static_cast<size_t>(p.shard_dim);
    if (p.shard_dim < 0 || d >= local.size()) return local;
    local[d] = 0;
    const Dims& lead = p.parts[0].lead_index;
    int64_t slots = 1;
    for (const FusedPart& part : p.parts) {
      if (!part.lead_index.empty()) {
        slots = std::max(slots, Plus(part.lead_index[0], 1));
      }
      if (part.lead_index != lead) continue;  // rows of the first slot
      const ParamSpec* c = find(part.checkpoint_name);
      if (c == nullptr || c->shape.size() <= d) continue;
      local[d] = Plus(local[d], part.local_extent > 0
                                    ? part.local_extent
                                    : PerRank(c->shape[d], tp));
    }
    if (!lead.empty()) local.insert(local.begin(), slots);
    return local;
  }
  const ParamSpec* c = find(p.consumes.empty() ? p.name : p.consumes[0]);
  if (c == nullptr) return {};
  Dims local = c->shape;
  switch (p.loader) {
    case LoaderKind::kColumn:
    case LoaderKind::kRow:
      if (p.shard_dim >= 0 && static_cast<size_t>(p.shard_dim) < local.size()) {
        local[p.shard_dim] = PerRank(local[p.shard_dim], tp);
      }
      break;
    case LoaderKind::kVocabParallel:
      if (!local.empty()) local[0] = PerRank(local[0], tp);
      break;
    default:
      break;
  }
  return local;
}

inline EngineParam TemplateParam(FuzzedDataProvider& in, const ModelSpec& model,
                          int32_t tp) {
  EngineParam p;
  p.name = kNames[in.ConsumeIntegralInRange<int>(0, kAllNames - 1)];
  const int loader = in.ConsumeIntegralInRange<int>(0, 6);
  p.loader = loader == 6 ? static_cast<LoaderKind>(in.ConsumeIntegral<uint8_t>())
                         : static_cast<LoaderKind>(loader);
  p.tp_size = in.ConsumeIntegralInRange<int>(0, 3) != 0
                  ? tp
                  : in.ConsumeIntegral<int32_t>();
  p.shard_dim = in.ConsumeIntegralInRange<int>(0, 7) != 0
                    ? in.ConsumeIntegralInRange<int32_t>(0, 2)
                    : in.ConsumeIntegral<int32_t>();
  if (in.ConsumeIntegralInRange<int>(0, 7) == 0) {
    p.flags = in.ConsumeIntegral<uint32_t>();
  }
  if (p.loader == LoaderKind::kFused || in.ConsumeIntegralInRange<int>(0, 7) == 0) {
    const int parts = in.ConsumeIntegralInRange<int>(0, 4);
    const bool lead = in.ConsumeIntegralInRange<int>(0, 3) == 0;
    const int per_slot = in.ConsumeIntegralInRange<int>(1, 2);
    std::vector<FusedPart> list;
    for (int i = 0; i < parts; ++i) {
      FusedPart part;
      part.checkpoint_name =
          kNames[in.ConsumeIntegralInRange<int>(0, kCheckpointNames - 1)];
      if (lead) part.lead_index.push_back(i / per_slot);
      if (in.ConsumeIntegralInRange<int>(0, 7) == 0) {
        part.lead_index.push_back(in.ConsumeIntegral<int64_t>());
      }
      if (in.ConsumeIntegralInRange<int>(0, 3) == 0) part.local_extent = Dim(in);
      list.push_back(std::move(part));
    }
    p.parts = FusedParts(std::move(list));
  }
  if (in.ConsumeIntegralInRange<int>(0, 5) == 0) {
    const int consumes = in.ConsumeIntegralInRange<int>(1, 3);
    for (int i = 0; i < consumes; ++i) {
      p.consumes.push_back(kNames[in.ConsumeIntegralInRange<int>(0, kAllNames - 1)]);
    }
  }
  // The dtype of what it loads, mostly (else the loader converts: fallback).
  const int32_t id = model.Find(p.parts.empty() ? p.name
                                                : p.parts[0].checkpoint_name);
  p.dtype = id >= 0 && in.ConsumeIntegralInRange<int>(0, 3) != 0
                ? model.params[id].dtype
                : PickDType(in);
  p.local_shape = in.ConsumeIntegralInRange<int>(0, 3) != 0
                      ? DerivedShape(model, p, tp)
                      : Shape(in, 4);
  // Now and then an FP8 weight (FP8 in flight), its scales named by any
  // name; mostly in e4m3, in blocks that may or may not fit.
  if (in.ConsumeIntegralInRange<int>(0, 5) == 0) {
    p.fp8.scale = kNames[in.ConsumeIntegralInRange<int>(0, kAllNames - 1)];
    static const int64_t kBlocks[] = {1, 2, 4, 128};
    p.fp8.block_rows = in.ConsumeIntegralInRange<int>(0, 7) != 0
                           ? kBlocks[in.ConsumeIntegralInRange<int>(0, 3)]
                           : in.ConsumeIntegral<int64_t>();
    p.fp8.block_cols = kBlocks[in.ConsumeIntegralInRange<int>(0, 3)];
    if (in.ConsumeIntegralInRange<int>(0, 3) != 0) p.dtype = DType::kF8E4M3;
  }
  return p;
}

// One rank's table: the template with its offsets laid out back to back in
// buffer 0, and now and then a deviation of this rank.
inline EngineTable RankTable(FuzzedDataProvider& in, const std::vector<EngineParam>& tmpl,
                      int32_t tp_rank, int32_t tp_size) {
  EngineTable t;
  t.tp_rank = tp_rank;
  t.tp_size = tp_size;
  t.node = "node-a";
  t.params = tmpl;
  int64_t at = 0;
  for (EngineParam& p : t.params) {
    switch (in.ConsumeIntegralInRange<int>(0, 15)) {
      case 0:
        p.local_shape = Shape(in, 4);
        break;
      case 1:
        p.name = kNames[in.ConsumeIntegralInRange<int>(0, kAllNames - 1)];
        break;
      case 2:
        p.byte_offset = in.ConsumeIntegral<int64_t>();
        break;
      case 3:
        p.buffer = in.ConsumeIntegralInRange<uint32_t>(0, 2);
        break;
      case 4:
        if (!p.parts.empty()) {
          // This rank's own list: the template's is shared by every rank.
          std::vector<FusedPart> parts = p.parts.get();
          parts.back().local_extent = Dim(in);
          p.parts = FusedParts(std::move(parts));
        }
        break;
      default:
        break;
    }
    if (p.byte_offset == 0) p.byte_offset = at;
    const int64_t bytes = TensorBytes(p.local_shape, p.dtype);
    if (bytes >= 0 && p.byte_offset >= 0) {
      int64_t end;
      if (CheckedAdd(p.byte_offset, bytes, &end)) at = std::max(at, end);
    }
  }
  switch (in.ConsumeIntegralInRange<int>(0, 7)) {
    case 0:
      break;  // empty: not checked
    case 1:
      t.buffer_bytes = {in.ConsumeIntegral<int64_t>()};
      break;
    case 2:
      t.buffer_bytes = {at, in.ConsumeIntegralInRange<int64_t>(0, 1 << 20)};
      break;
    default:
      t.buffer_bytes = {at};
      break;
  }
  return t;
}

struct LayoutCase {
  ModelSpec model;
  int32_t tp = 1;          // the instance's tp_size as the tables say it
  size_t entries = 0;      // engine parameters per table
  std::vector<EngineTable> tables;
};

inline LayoutCase BuildLayoutCase(FuzzedDataProvider& in) {
  LayoutCase out;
  ModelSpec& model = out.model;
  const int params = in.ConsumeIntegralInRange<int>(1, 8);
  for (int i = 0; i < params; ++i) {
    ParamSpec c;
    c.name = kNames[in.ConsumeIntegralInRange<int>(0, kCheckpointNames - 1)];
    c.dtype = PickDType(in);
    c.shape = Shape(in, 3);
    model.params.push_back(std::move(c));
  }
  model.BuildIndex();

  int32_t tp = in.ConsumeIntegralInRange<int32_t>(1, 4);
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0) tp = in.ConsumeIntegral<int32_t>();
  std::vector<EngineParam> tmpl;
  const int entries = in.ConsumeIntegralInRange<int>(1, 6);
  for (int i = 0; i < entries; ++i) tmpl.push_back(TemplateParam(in, model, tp));

  const int32_t tables = tp >= 1 && tp <= 4 ? tp : in.ConsumeIntegralInRange<int>(1, 3);
  std::vector<EngineTable> ranks;
  for (int32_t r = 0; r < tables; ++r) {
    int32_t rank = r;
    if (in.ConsumeIntegralInRange<int>(0, 15) == 0) rank = in.ConsumeIntegral<int32_t>();
    ranks.push_back(RankTable(in, tmpl, rank, tp));
  }
  if (in.ConsumeIntegralInRange<int>(0, 15) == 0 && ranks.size() > 1) {
    std::swap(ranks.front(), ranks.back());  // tables in any order
  }

  out.tp = tp;
  out.entries = tmpl.size();
  out.tables = std::move(ranks);
  return out;
}

}  // namespace fuzz
}  // namespace ferry

#endif  // FERRY_TESTS_FUZZ_LAYOUT_INPUT_H_
