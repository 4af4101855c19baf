// ferry_plan: plan a weight sync offline and explain it.
//
//   ferry_plan --model=llama-3.1-8b --trainer=tp=4,dp=2 --engine=tp=8
//              --replicas=2 [--json] [--all] [--cluster=...]
//
// Builds the trainer's pieces (Megatron/FSDP conventions) and the engine's
// parameter tables (vLLM conventions) from a model file in shared/models,
// resolves the engine layout, plans every instance and prints, per
// instance, how each parameter lands and why. No daemon, no GPU.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <memory>

#include <gflags/gflags.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cluster_model.h"
#include "core/exchange.h"
#include "core/fp8_sources.h"
#include "core/models/quantized_engine.h"
#include "core/explain.h"
#include "core/layout_resolution.h"
#include "core/planner.h"
#include "tools/model_args.h"
#include "tools/quantizer_gpus.h"
#include "common/flags_help.h"

DEFINE_string(model, "llama-3.1-8b",
              "model file in shared/models, without .json (llama-3.1-8b, "
              "llama-3.1-70b, qwen3-30b-a3b, qwen3-235b-a22b, deepseek-v3, "
              "kimi-k2-instruct, tiny-llama, tiny-moe)");
DEFINE_string(trainer, "tp=4,dp=2",
              "trainer parallelism: tp=N,pp=N,dp=N,ep=N plus the words fsdp "
              "and fused_qkv");
DEFINE_string(engine, "tp=8", "engine parallelism: tp=N, and ep for expert "
                               "parallel MoE");
DEFINE_int32(replicas, 1, "engine instances with this layout");
DEFINE_int32(layers, 0, "keep only the first N layers (0: all)");
DEFINE_int64(bucket_mb, 64, "staging bucket size in MiB");
DEFINE_bool(relay, true, "replicas relay from each other instead of each "
                         "reading every byte from the trainer");
DEFINE_bool(json, false, "print the explanation as JSON");
DEFINE_bool(all, false, "list every parameter, not the first 40");
DEFINE_bool(exchange, false,
            "--cluster: replicas that ferryd does not relay exchange the "
            "busiest trainer ranks' buckets, as ferryd --exchange runs them "
            "(core/exchange.h)");
DEFINE_bool(quantize_in_flight, false,
            "the model's FP8 checkpoint (deepseek-v3, kimi-k2-instruct) "
            "served by FP8 engines from a trainer that holds it in bf16: "
            "the engines declare every FP8 weight quantized in flight "
            "(docs/api.md, \"Quantized in flight\"), so FP8 bytes and "
            "scales cross the network, quantized on the trainer's nodes "
            "(with --cluster)");
DEFINE_double(delta_density, -1,
              "with --cluster: model delta versions where this fraction of "
              "the elements changes per version (0.05: 5%); the bytes between "
              "nodes become patches (docs/api.md, \"Delta versions\"). "
              "Negative: every byte.");
DEFINE_string(cluster, "",
              "model one version on a cluster instead of explaining the plan: "
              "gpus_per_node=8,nic_gbits=400,nvlink_gbytes=450 (any subset; "
              "these are the defaults). Trainer rank r runs on node "
              "train-(r/8), engine ranks on infer-N in replica order. Prints "
              "each port's load, the modeled time, the lower bound and their "
              "ratio (core/cluster_model.h); --json for scripts");

namespace ferry {
namespace {

int Fail(const absl::Status& s) {
  std::cerr << "ferry_plan: " << s.message() << "\n";
  return 2;
}

int Main() {
  auto schema = LoadNamedModelSchema(FLAGS_model);
  if (!schema.ok()) return Fail(schema.status());
  if (FLAGS_layers > 0) {
    schema = FirstLayers(*schema, FLAGS_layers);
    if (!schema.ok()) return Fail(schema.status());
  }
  auto trainer = ParseTrainerSpec(FLAGS_trainer);
  if (!trainer.ok()) return Fail(trainer.status());
  auto engine = ParseEngineSpec(FLAGS_engine);
  if (!engine.ok()) return Fail(engine.status());

  if (FLAGS_quantize_in_flight &&
      gflags::GetCommandLineFlagInfoOrDie("cluster").is_default) {
    // The explanation would list the derived FP8 tensors as the quantizer
    // ranks' "registered pieces"; ferryctl explain names a running
    // stream's quantized weights as such.
    return Fail(absl::InvalidArgumentError(
        "--quantize_in_flight models a version on a cluster: give --cluster "
        "(ferryctl explain names a running stream's quantized weights)"));
  }
  const auto t0 = std::chrono::steady_clock::now();
  // The trainer's model: the checkpoint's, or with --quantize_in_flight
  // its bf16 form; the planner's gains the derived FP8 tensors.
  ModelSpec model = FLAGS_quantize_in_flight ? TrainerOf(schema->spec)
                                             : schema->spec;
  auto sources = BuildTrainerLayout(model, schema->config, *trainer);
  if (!sources.ok()) return Fail(sources.status());
  const size_t trainer_ranks = sources->size();
  auto tables = BuildEngineTables(schema->spec, schema->config, *engine);
  if (!tables.ok()) return Fail(tables.status());
  if (FLAGS_quantize_in_flight) {
    DeclareQuantizedInFlight(
        schema->config.fp8_block > 0 ? schema->config.fp8_block : 128,
        &*tables);
  }
  auto resolved = ResolveDestinationLayout(model, *tables);
  if (!resolved.ok()) return Fail(resolved.status());
  auto layout = std::make_shared<std::vector<RankLayout>>();
  for (const ResolvedRank& r : resolved->ranks) layout->push_back(r.layout);
  // FP8 in flight: quantizer ranks on the trainer's nodes feed the
  // engines' FP8 weights and scales (core/fp8_sources.h).
  std::vector<int> source_gpu_of;
  int64_t quantized_tensors = 0, split_tensors = 0;
  if (FLAGS_quantize_in_flight) {
    std::vector<std::vector<RankLayout>> layouts = {*layout};
    auto fp8 = AddFp8Sources(model, *sources, {&*resolved}, &layouts);
    if (!fp8.ok()) return Fail(fp8.status());
    if (fp8->quantized.empty()) {
      return Fail(absl::InvalidArgumentError(absl::StrCat(
          "--quantize_in_flight: ", FLAGS_model,
          " has no FP8 block-scaled weights (deepseek-v3, kimi-k2-instruct "
          "have)")));
    }
    SpreadOverTrainerGpus(trainer_ranks, &*fp8, &source_gpu_of);
    quantized_tensors = static_cast<int64_t>(fp8->quantized.size());
    for (const QuantizedParam& q : fp8->quantized) split_tensors += q.split();
    model = std::move(fp8->model);
    *sources = std::move(fp8->sources);
    *layout = std::move(layouts[0]);
  }
  std::vector<Instance> instances;
  for (int k = 0; k < FLAGS_replicas; ++k) {
    Instance inst;
    inst.id = absl::StrCat("r", k);
    inst.layout = layout;
    for (int r = 0; r < engine->tp; ++r) {
      inst.nodes.push_back(absl::StrCat(engine->node_prefix,
                                        (k * engine->tp + r) / engine->ranks_per_node));
    }
    instances.push_back(std::move(inst));
  }
  PlanOptions options;
  options.bucket_bytes = FLAGS_bucket_mb << 20;
  options.relay = FLAGS_relay;
  const auto t1 = std::chrono::steady_clock::now();
  auto planner = SourcePlanner::Create(model, *sources, options);
  if (!planner.ok()) return Fail(planner.status());
  auto plan = (*planner)->PlanInstances(instances);
  if (!plan.ok()) return Fail(plan.status());
  const auto t2 = std::chrono::steady_clock::now();

  if (!gflags::GetCommandLineFlagInfoOrDie("cluster").is_default) {
    auto cluster = ParseClusterSpec(FLAGS_cluster);
    if (!cluster.ok()) return Fail(cluster.status());
    if (FLAGS_delta_density > 1) {
      return Fail(absl::InvalidArgumentError(
          "--delta_density must be at most 1 (a fraction of the elements)"));
    }
    cluster->delta_density = FLAGS_delta_density;
    // ferryd runs only the relays it can (transfer_queue.cc): the others
    // read the trainer as ferryd plans them (StreamPlan::DirectPlan).
    Plan direct;
    direct.instances.resize(plan->instances.size());
    for (size_t k = 0; k < plan->instances.size(); ++k) {
      if (plan->instances[k].relay_from < 0) continue;
      direct.instances[k] = (*planner)->PlanFromSourcesOf(
          *plan, instances, static_cast<int32_t>(k));
    }
    // Exchanges between the replicas ferryd does not relay, as ferryd
    // chooses them (daemon/plans/plan_cache.cc).
    std::vector<Exchange> exchanges(instances.size());
    const auto e0 = std::chrono::steady_clock::now();
    if (FLAGS_exchange) {
      exchanges = ChooseExchanges(
          **planner, *sources, instances, *plan,
          [&](int32_t k) -> const InstancePlan& { return direct.instances[k]; });
    }
    const double exchange_ms =
        std::chrono::duration<double, std::milli>(
            std::chrono::steady_clock::now() - e0)
            .count();
    auto report = ModelCluster(
        model, *sources, instances, *plan, *cluster, &direct,
        &(*planner)->index(), &exchanges,
        source_gpu_of.empty() ? nullptr : &source_gpu_of);
    if (!report.ok()) return Fail(report.status());
    if (FLAGS_json) {
      std::cout << ClusterReportJson(*report) << "\n";
    } else {
      std::cout << absl::StrFormat(
          "%s: trainer %s (%d ranks), engine %s x %d replicas; planned in "
          "%.0f ms%s\n",
          schema->name, FLAGS_trainer, trainer_ranks, FLAGS_engine,
          FLAGS_replicas,
          std::chrono::duration<double, std::milli>(t2 - t1).count(),
          FLAGS_exchange
              ? absl::StrFormat(", exchanges chosen in %.0f ms", exchange_ms)
              : "")
                << FormatClusterReport(*report);
      if (FLAGS_quantize_in_flight) {
        std::cout << absl::StrFormat(
            "quantized in flight: %d tensors from a bf16 trainer (%d split "
            "over trainer nodes, each node quantizing its parts), quantized "
            "on the trainer's nodes (modeled on their GPUs; network only, "
            "the quantize step's time is not modeled)\n",
            quantized_tensors, split_tensors);
      }
    }
    return 0;
  }

  for (size_t k = 0; k < plan->instances.size(); ++k) {
    const InstanceExplanation e = ExplainInstance(
        model, *sources, *plan, k, *layout, &*resolved);
    if (FLAGS_json) {
      std::cout << ExplanationToJson(e) << "\n";
    } else {
      std::cout << FormatExplanation(e, FLAGS_all || k > 0 ? (k > 0 ? 1 : 0) : 40)
                << "\n";
    }
  }
  if (!FLAGS_json) {
    auto ms = [](auto a, auto b) {
      return std::chrono::duration<double, std::milli>(b - a).count();
    };
    std::cout << absl::StrFormat(
        "%s: %d parameters, %s; trainer %s (%d ranks), engine %s x %d "
        "replicas\nlayouts built in %.0f ms, planned in %.0f ms; the trainer "
        "sends %s; plan digest %016x\n",
        schema->name, model.params.size(),
        HumanBytes(TotalBytes(model)), FLAGS_trainer, trainer_ranks,
        FLAGS_engine, FLAGS_replicas, ms(t0, t1), ms(t1, t2),
        HumanBytes(plan->source_bytes), plan->digest);
  }
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "plan a weight sync offline and explain it\n"
      "  ferry_plan --model=llama-3.1-8b --trainer=tp=4,dp=2 --engine=tp=8");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  return ferry::Main();
}
