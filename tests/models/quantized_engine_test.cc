// FP8 in flight from a bf16 trainer into an FP8 model's engines
// (core/models/quantized_engine.h, and ferry_plan's placement of the
// quantizing, tools/quantizer_gpus.h) on the real DeepSeek-V3 architecture
// (first 4 layers: 3 dense, 1 MoE): the bf16 trainer's model, the FP8
// engines' declarations, and what the planner then carries, against
// counts taken from the checkpoint's own tensor list.
#include "core/models/quantized_engine.h"

#include <catch2/catch.hpp>
#include <map>
#include <string>

#include "absl/strings/match.h"
#include "core/fp8_sources.h"
#include "core/fp8_targets.h"
#include "core/models/engine_layout.h"
#include "core/models/model_schema.h"
#include "core/models/trainer_layout.h"
#include "core/planner.h"
#include "core/region_copy.h"
#include "tools/model_args.h"
#include "tools/quantizer_gpus.h"

namespace ferry {
namespace {

TEST_CASE("DeepSeek-V3 from a bf16 trainer into FP8 TP 4 engines: every FP8 "
          "weight quantized in flight, FP8 bytes and scales planned") {
  auto full = LoadNamedModelSchema("deepseek-v3");
  REQUIRE(full.ok());
  auto schema = FirstLayers(*full, 4);
  REQUIRE(schema.ok());
  const ModelSpec& fp8_ckpt = schema->spec;
  // The checkpoint's own counts: FP8 weights, their scales.
  int64_t fp8_weights = 0, fp8_bytes = 0, scale_bytes = 0;
  for (const ParamSpec& p : fp8_ckpt.params) {
    if (IsFp8Format(p.dtype)) {
      ++fp8_weights;
      fp8_bytes += BoxBytes(FullBox(p.shape), p.dtype);
      const int32_t s = fp8_ckpt.Find(p.name + "_scale_inv");
      REQUIRE(s >= 0);
      scale_bytes += BoxBytes(FullBox(fp8_ckpt.params[s].shape), DType::kF32);
    }
  }
  REQUIRE(fp8_weights > 0);

  const ModelSpec trainer = TrainerOf(fp8_ckpt);
  CHECK(trainer.params.size() == fp8_ckpt.params.size() - fp8_weights);
  for (const ParamSpec& p : trainer.params) {
    CHECK_FALSE(IsFp8Format(p.dtype));
    CHECK_FALSE(absl::EndsWith(p.name, "_scale_inv"));
  }

  EngineParallelism engine;
  engine.tp = 4;
  auto tables = BuildEngineTables(fp8_ckpt, schema->config, engine);
  REQUIRE(tables.ok());
  // Rank 0 declares each FP8 weight it holds (the fused w13 / w2 and
  // gate_up count once each).
  CHECK(DeclareQuantizedInFlight(128, &*tables) > 0);
  auto resolved = ResolveDestinationLayout(trainer, *tables);
  INFO(resolved.status().message());
  REQUIRE(resolved.ok());
  int quantized_decisions = 0, through_loader = 0;
  for (const ParamDecision& d : resolved->ranks[0].decisions) {
    if (d.resolution == Resolution::kQuantized) ++quantized_decisions;
    // Only the bf16 parameters (embeddings, norms, the router) stay
    // direct; nothing falls back as bf16.
    CHECK(d.resolution != Resolution::kFallback);
    if (absl::StrContains(d.reason, "through the engine's loader")) {
      // MLA's kv_b_proj, one per layer: vLLM transforms it after loading.
      CHECK(absl::StrContains(d.engine_name, "kv_b_proj.weight"));
      ++through_loader;
    }
  }
  CHECK(quantized_decisions > 0);
  CHECK(through_loader == 4);
  // Its FP8 elements and scales, whole, under the checkpoint's names.
  int quantized_fallback = 0;
  for (const FallbackTensor& f : resolved->ranks[0].fallback) {
    CHECK(f.quantized());
    CHECK(absl::StrContains(f.name, "kv_b_proj.weight"));
    CHECK(absl::EndsWith(f.name, "_scale_inv") == f.scales);
    ++quantized_fallback;
  }
  CHECK(quantized_fallback == 8);

  TrainerParallelism tp;
  tp.tp = 2;
  tp.dp = 2;
  auto sources = BuildTrainerLayout(trainer, schema->config, tp);
  REQUIRE(sources.ok());
  std::vector<std::vector<RankLayout>> layouts(1);
  for (const ResolvedRank& r : resolved->ranks) layouts[0].push_back(r.layout);
  auto fp8 = AddFp8Sources(trainer, *sources, {&*resolved}, &layouts);
  REQUIRE(fp8.ok());
  // Every FP8 weight of the checkpoint, once (the engines' fused
  // gate_up / w13 read the same checkpoint tensors).
  CHECK(static_cast<int64_t>(fp8->quantized.size()) == fp8_weights);

  std::vector<int> gpu_of;
  SpreadOverTrainerGpus(sources->size(), &*fp8, &gpu_of);
  REQUIRE(gpu_of.size() == fp8->sources.size());
  for (size_t i = sources->size(); i < fp8->sources.size(); ++i) {
    REQUIRE(gpu_of[i] >= 0);
    CHECK(fp8->sources[gpu_of[i]].node == fp8->sources[i].node);
  }
  // The planner moves, into one TP 4 instance, the FP8 checkpoint's bytes
  // and scales for those weights, not bf16.
  auto planner = SourcePlanner::Create(fp8->model, fp8->sources, PlanOptions{});
  REQUIRE(planner.ok());
  Instance inst;
  inst.id = "r0";
  inst.layout = std::make_shared<std::vector<RankLayout>>(layouts[0]);
  auto plan = (*planner)->PlanInstances({inst});
  REQUIRE(plan.ok());
  int64_t derived = 0;
  for (const Copy& c : plan->instances[0].copies) {
    if (c.param >= static_cast<int32_t>(trainer.params.size())) {
      derived += c.bytes;
    }
  }
  // TP 4 replicates some FP8 weights (MLA's q_a/kv_a projections): at
  // least the checkpoint's bytes, and no bf16 for any of them.
  CHECK(derived >= fp8_bytes + scale_bytes);
  CHECK(derived < 2 * (fp8_bytes + scale_bytes));
}

}  // namespace
}  // namespace ferry
