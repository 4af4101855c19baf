// layout_resolution_fuzzer: core's layout resolution (core/layout_resolution.h)
// on engine parameter tables built from fuzz bytes, then what the daemon's
// plan cache does with an instance that resolves: ValidateDestination, and a
// plan (core/planner.h) from a simple trainer layout.
//
// The bytes drive a FuzzedDataProvider: first the model and the instance's
// tables (tests/fuzz/layout_input.h), then the trainer layout and the plan
// options.
//
// ResolveDestinationLayout promises an error or a result for any input; a
// crash, sanitizer report, hang or huge allocation is a bug, and so is a
// result that breaks its contract (one resolved rank per TP rank, one
// decision per engine parameter) or a plan in which a destination does not
// receive exactly the bytes of its pieces.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/checked_math.h"
#include "core/layout_resolution.h"
#include "core/planner.h"
#include "core/validation.h"
#include "tests/fuzz/layout_input.h"

namespace ferry {
namespace {

using fuzz::TensorBytes;

constexpr int64_t kPlanBytesLimit = int64_t{256} << 20;

[[noreturn]] void Broken(const char* what) {
  std::fprintf(stderr, "layout_resolution_fuzzer: invariant broken: %s\n",
               what);
  std::abort();
}

int64_t PieceBytes(const Piece& piece, const ModelSpec& model) {
  const DType dtype = model.params[piece.param].dtype;
  return Volume(StorageBox(piece.box, dtype)) * UnitBytes(dtype);
}

// The trainer: every parameter on rank 0, or split in two along dim 0 over
// ranks 0 and 1, or whole on two replicas (DP).
std::vector<RankLayout> Sources(FuzzedDataProvider& in, const ModelSpec& model) {
  const int mode = in.ConsumeIntegralInRange<int>(0, 2);
  std::vector<RankLayout> ranks(mode == 0 ? 1 : 2);
  for (size_t r = 0; r < ranks.size(); ++r) {
    ranks[r].rank = static_cast<int32_t>(r);
    ranks[r].node = in.ConsumeBool() ? "node-a" : "node-b";
    ranks[r].buffer_bytes = {0};
  }
  auto add = [&](RankLayout& rank, int32_t param, Box box) {
    const DType dtype = model.params[param].dtype;
    Piece piece = Piece::Contiguous(param, box, 0, rank.buffer_bytes[0], dtype);
    rank.buffer_bytes[0] += Volume(StorageBox(box, dtype)) * UnitBytes(dtype);
    rank.pieces.push_back(std::move(piece));
  };
  for (size_t i = 0; i < model.params.size(); ++i) {
    const ParamSpec& c = model.params[i];
    const int32_t id = static_cast<int32_t>(i);
    if (mode == 1 && c.shape.size() >= 2 && c.shape[0] >= 2) {
      Box lo = FullBox(c.shape), hi = FullBox(c.shape);
      lo.extent[0] = c.shape[0] / 2;
      hi.offset[0] = lo.extent[0];
      hi.extent[0] = c.shape[0] - lo.extent[0];
      add(ranks[0], id, lo);
      add(ranks[1], id, hi);
    } else {
      add(ranks[0], id, FullBox(c.shape));
      if (mode == 2) add(ranks[1], id, FullBox(c.shape));
    }
  }
  return ranks;
}

// A quantized target (FP8 in flight) places a box inside its checkpoint
// tensor, whole blocks, and writes inside the rank's buffers (its weight
// and scale tensors were checked against them).
void CheckTarget(const ModelSpec& model, const ResolvedRank& r,
                 const QuantizedTarget& t) {
  if (t.param < 0 || t.param >= static_cast<int32_t>(model.params.size())) {
    Broken("quantized target names no checkpoint parameter");
  }
  if (!ValidateBoxInShape(t.box, model.params[t.param].shape).ok()) {
    Broken("quantized target box outside its checkpoint tensor");
  }
  if (r.layout.buffer_bytes.empty() || Volume(t.box.extent) == 0) return;
  auto last_byte = [&](int64_t offset, const Dims& strides, const Dims& extent,
                       int64_t unit) {
    int64_t at = offset;
    for (size_t i = 0; i < extent.size(); ++i) at += (extent[i] - 1) * strides[i] * unit;
    return at + unit - 1;
  };
  const Box blocks = t.ScaleBox();
  if (t.weight_buffer >= r.layout.buffer_bytes.size() ||
      t.scale_buffer >= r.layout.buffer_bytes.size() ||
      t.weight_offset < 0 || t.scale_offset < 0 ||
      last_byte(t.weight_offset, t.weight_strides, t.box.extent, 1) >=
          r.layout.buffer_bytes[t.weight_buffer] ||
      last_byte(t.scale_offset, t.scale_strides, blocks.extent, 4) >=
          r.layout.buffer_bytes[t.scale_buffer]) {
    Broken("quantized target writes outside the rank's buffers");
  }
}

void PlanResolved(FuzzedDataProvider& in, const ModelSpec& model,
                  const ResolvedInstance& resolved) {
  int64_t total = 0;
  for (const ParamSpec& c : model.params) {
    const int64_t bytes = TensorBytes(c.shape, c.dtype);
    if (bytes < 0 || !CheckedAdd(total, bytes, &total)) return;
  }
  if (total > kPlanBytesLimit) return;  // legal, but slow to plan here
  auto layout = std::make_shared<std::vector<RankLayout>>();
  for (const ResolvedRank& r : resolved.ranks) layout->push_back(r.layout);
  if (!ValidateDestination(model, *layout, "fuzz-0").ok()) return;
  const std::vector<RankLayout> sources = Sources(in, model);
  std::vector<Instance> instances = {Instance{"fuzz-0", layout, {}}};
  if (in.ConsumeBool()) instances.push_back(Instance{"fuzz-1", layout, {}});
  PlanOptions options;
  static const int64_t kBuckets[] = {int64_t{64} << 20, 1 << 20, 64 << 10};
  options.bucket_bytes = kBuckets[in.ConsumeIntegralInRange<int>(0, 2)];
  options.relay = in.ConsumeBool();
  absl::StatusOr<Plan> plan = PlanTransfers(model, sources, instances, options);
  if (!plan.ok()) Broken("a validated instance and tiling sources do not plan");
  int64_t want = 0;
  for (const RankLayout& r : *layout) {
    for (const Piece& piece : r.pieces) want += PieceBytes(piece, model);
  }
  for (const InstancePlan& ip : plan->instances) {
    if (ip.relay_from >= 0) continue;
    int64_t got = 0;
    for (const Copy& c : ip.copies) got += c.bytes;
    if (got != want || ip.bytes != want) {
      Broken("a planned instance does not receive exactly its pieces' bytes");
    }
  }
  (void)PlanDigest(*plan);
}

}  // namespace
}  // namespace ferry

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferry;
  FuzzedDataProvider in(data, size);

  fuzz::LayoutCase c = fuzz::BuildLayoutCase(in);
  const ModelSpec& model = c.model;
  absl::StatusOr<ResolvedInstance> resolved = ResolveDestinationLayout(model, c.tables);
  if (!resolved.ok()) return 0;
  if (static_cast<int64_t>(resolved->ranks.size()) != c.tp) {
    Broken("resolved ranks != tp_size");
  }
  for (const ResolvedRank& r : resolved->ranks) {
    if (r.decisions.size() != c.entries) Broken("decisions != parameters");
    for (const Piece& piece : r.layout.pieces) {
      if (piece.param < 0 || piece.param >= static_cast<int32_t>(model.params.size())) {
        Broken("resolved piece names no checkpoint parameter");
      }
    }
    for (const QuantizedTarget& t : r.quantized) CheckTarget(model, r, t);
  }
  if (ValidateModelSpec(model).ok()) PlanResolved(in, model, *resolved);
  return 0;
}
