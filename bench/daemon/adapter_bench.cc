// adapter_bench: one version of a LoRA adapter (docs/api.md, "LoRA
// adapters") on one node, begin to committed, as an RL trainer sees it
// after every step.
//
// An in-process ferryd on a temporary unix socket; a TP1 trainer of the
// demo model (the Llama-3.1-8B tensor set scaled to ~1.6 GiB) publishes
// the base once into engine instance "e" (the demo engine table, TP
// --tp); an adapter trainer holds a rank --rank adapter (BF16, PEFT names)
// on every linear layer (q, k, v, o, gate, up, down) and publishes it as
// versions of stream "lora" after the adapter is loaded on "e". Each
// engine rank's adapter manager copies its shares out of staging (memcpy,
// as an engine copies them into its adapter buffers) at APPLY. Measured:
// PublishVersion (BeginVersion .. CommitVersion returned with the outcome:
// PREPARE, PAUSE, the copy, APPLY, COMMIT) over --versions versions after
// --warmup; the bytes checked once at the end against the trainer's.
//
// Against, in the same run: single-thread memcpy of the adapter's bytes
// (what moving them costs at the very least, twice: into staging, out to
// the engine). Target: under 5 ms per version on this machine.
//
//   bazel run -c opt //bench/daemon:adapter_bench -- [--rank=16] [--tp=1]
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/daemon/bench_daemon.h"
#include "bench/daemon/bench_figures.h"
#include "client/connection.h"
#include "examples/demo/demo_model.h"
#include "examples/demo/verifying_engine.h"
#include "client/destination_client.h"
#include "client/lifecycle_client.h"
#include "client/shared_tensor_arena.h"
#include "client/source_client.h"
#include "core/models/trainer_layout.h"
#include "core/region_copy.h"
#include "gflags/gflags.h"
#include "glog/logging.h"
#include "common/flags_help.h"

DEFINE_string(scale, "demo", "demo model scale: demo (~1.6 GiB), small, tiny");
DEFINE_int32(rank, 16, "the adapter's LoRA rank r");
DEFINE_int32(tp, 1, "the engine instance's TP size");
DEFINE_int32(versions, 50, "adapter versions measured");
DEFINE_int32(warmup, 5, "adapter versions before the measured ones");

namespace ferry {
namespace {

using bench::Median;

constexpr const char* kModules[] = {"self_attn.q_proj", "self_attn.k_proj",
                                    "self_attn.v_proj", "self_attn.o_proj",
                                    "mlp.gate_proj",    "mlp.up_proj",
                                    "mlp.down_proj"};

int Main() {
  absl::StatusOr<std::unique_ptr<bench::BenchDaemon>> daemon =
      bench::BenchDaemon::Start();
  if (!daemon.ok()) {
    LOG(ERROR) << daemon.status();
    return 1;
  }
  const Connection* c = &(*daemon)->connection();
  absl::StatusOr<ModelSchema> schema =
      LoadDemoModel("llama-3.1-8b", FLAGS_scale);
  if (!schema.ok()) {
    LOG(ERROR) << schema.status();
    return 1;
  }

  // The base, once.
  absl::StatusOr<std::vector<RankLayout>> layouts =
      BuildTrainerLayout(schema->spec, schema->config, TrainerParallelism{});
  if (!layouts.ok()) return 1;
  const RankLayout& base_layout = (*layouts)[0];
  auto base = SharedTensorArena::Create("bench.lora.base",
                                        base_layout.buffer_bytes[0], 0);
  if (!base.ok()) return 1;
  SourceOptions so;
  so.stream = "policy";
  auto base_source = SourceClient::Register(
      *c, so, SourceLayout{schema->spec, base_layout.pieces, {(*base)->Describe()}});
  if (!base_source.ok()) {
    LOG(ERROR) << base_source.status();
    return 1;
  }

  // The adapter: lora_A [r, in] and lora_B [out, r] of every linear layer.
  ModelSpec lora;
  std::vector<Piece> pieces;
  int64_t bytes = 0;
  for (int64_t layer = 0; layer < schema->config.num_layers; ++layer) {
    for (const char* m : kModules) {
      const std::string stem = absl::StrCat("model.layers.", layer, ".", m);
      const int32_t w = schema->spec.Find(stem + ".weight");
      if (w < 0) continue;
      const Dims& shape = schema->spec.params[w].shape;
      for (bool a : {true, false}) {
        ParamSpec p{absl::StrCat("base_model.model.", stem, ".lora_",
                                 a ? "A" : "B", ".weight"),
                    DType::kBF16,
                    a ? Dims{FLAGS_rank, shape[1]} : Dims{shape[0], FLAGS_rank}};
        pieces.push_back(Piece::Contiguous(
            static_cast<int32_t>(lora.params.size()), FullBox(p.shape), 0,
            bytes, p.dtype));
        bytes += BoxBytes(FullBox(p.shape), p.dtype);
        lora.params.push_back(std::move(p));
      }
    }
  }
  lora.BuildIndex();
  auto adapter = SharedTensorArena::Create("bench.lora.adapter", bytes, 0);
  if (!adapter.ok()) return 1;
  SourceOptions lo;
  lo.stream = "lora";
  auto lora_source = SourceClient::Register(
      *c, lo, SourceLayout{lora, pieces, {(*adapter)->Describe()}});
  if (!lora_source.ok()) {
    LOG(ERROR) << lora_source.status();
    return 1;
  }

  // The engine: the demo table; its adapter manager copies each share.
  struct Rank {
    std::unique_ptr<VerifyingEngine> engine;
    std::unique_ptr<DestinationClient> client;
    absl::Mutex mu;
    std::vector<uint8_t> held;  // the shares, as the engine keeps them
    int64_t version = 0;
  };
  std::vector<std::unique_ptr<Rank>> ranks;
  for (int r = 0; r < FLAGS_tp; ++r) {
    auto rank = std::make_unique<Rank>();
    auto engine = VerifyingEngine::Create(*schema, FLAGS_tp, r, {},
                                          absl::StrCat("bench.lora.e", r));
    if (!engine.ok()) return 1;
    rank->engine = *std::move(engine);
    DestinationCallbacks cb;
    Rank* self = rank.get();
    cb.on_adapter_apply = [self](const std::string&, int64_t v,
                                 const std::string&,
                                 const std::vector<FallbackTensorView>& shares) {
      absl::MutexLock l(&self->mu);
      size_t total = 0;
      for (const auto& s : shares) total += s.bytes.size();
      self->held.resize(total);
      size_t at = 0;
      for (const auto& s : shares) {
        std::memcpy(self->held.data() + at, s.bytes.data(), s.bytes.size());
        at += s.bytes.size();
      }
      self->version = v;
      return absl::OkStatus();
    };
    cb.on_adapter_unload = [](const std::string&) { return absl::OkStatus(); };
    DestinationOptions o;
    o.instance_id = "e";
    o.stream = "policy";
    o.tp_rank = r;
    o.tp_size = FLAGS_tp;
    auto client = DestinationClient::Register(
        *c, o,
        DestinationLayout::FromEngineTable(rank->engine->table(),
                                           {rank->engine->arena().Describe()}),
        std::move(cb));
    if (!client.ok()) {
      LOG(ERROR) << client.status();
      return 1;
    }
    rank->client = *std::move(client);
    ranks.push_back(std::move(rank));
  }
  absl::StatusOr<PublishOutcome> v1 = (*base_source)->PublishVersion(1);
  if (!v1.ok() || !v1->all_committed()) {
    LOG(ERROR) << "the base did not commit";
    return 1;
  }
  absl::StatusOr<v1::InstanceStatus> loaded = LoadAdapter(
      *c, "e", "bench", "lora",
      absl::StrCat(R"({"peft_type": "LORA", "r": )", FLAGS_rank,
                   R"(, "lora_alpha": 32})"));
  if (!loaded.ok()) {
    LOG(ERROR) << loaded.status();
    return 1;
  }

  std::vector<double> times;
  const int total = FLAGS_warmup + FLAGS_versions;
  for (int v = 1; v <= total; ++v) {
    // A trainer step changes every byte.
    uint8_t* data = (*adapter)->data();
    for (int64_t i = 0; i < bytes; ++i) {
      data[i] = static_cast<uint8_t>(i * 131 + v * 7 + (i >> 12));
    }
    const absl::Time start = absl::Now();
    absl::StatusOr<PublishOutcome> out = (*lora_source)->PublishVersion(v);
    const double t = absl::ToDoubleSeconds(absl::Now() - start);
    if (!out.ok() || !out->all_committed() || out->instances.size() != 1) {
      LOG(ERROR) << "adapter version " << v << ": "
                 << (out.ok() ? out->Summary() : out.status().ToString());
      return 1;
    }
    if (v > FLAGS_warmup) times.push_back(t);
  }
  // The bytes: a TP1 engine holds the whole adapter, in the trainer's order
  // of tensors by name (the daemon sorts them), so compare tensor by tensor.
  int64_t share_bytes = 0;
  for (auto& r : ranks) {
    absl::MutexLock l(&r->mu);
    share_bytes += static_cast<int64_t>(r->held.size());
    if (r->version != total) {
      LOG(ERROR) << "an engine rank holds adapter version " << r->version;
      return 1;
    }
  }
  if (FLAGS_tp == 1) {
    std::vector<std::pair<std::string, int32_t>> by_name;
    for (size_t i = 0; i < lora.params.size(); ++i) {
      by_name.emplace_back(lora.params[i].name, static_cast<int32_t>(i));
    }
    std::sort(by_name.begin(), by_name.end());
    absl::MutexLock l(&ranks[0]->mu);
    int64_t at = 0;
    for (const auto& [name, i] : by_name) {
      const Piece& p = pieces[i];
      const int64_t n = BoxBytes(p.box, lora.params[i].dtype);
      if (std::memcmp(ranks[0]->held.data() + at,
                      (*adapter)->data() + p.byte_offset,
                      static_cast<size_t>(n)) != 0) {
        LOG(ERROR) << "tensor " << name << " differs from the trainer's";
        return 1;
      }
      at += n;
    }
  }
  std::vector<uint8_t> scratch(static_cast<size_t>(bytes));
  const double memcpy_bw =
      bench::MemcpyBandwidth((*adapter)->data(), scratch.data(), bytes);
  std::sort(times.begin(), times.end());
  std::printf("adapter_bench: %ld cores online, ferryd in process\n",
              sysconf(_SC_NPROCESSORS_ONLN));
  std::printf("model: llama-3.1-8b %s, %lld layers; adapter r=%d on q, k, v, "
              "o, gate, up, down: %zu tensors, %.2f MiB BF16; engine TP%d "
              "(%.2f MiB of shares)\n",
              FLAGS_scale.c_str(),
              static_cast<long long>(schema->config.num_layers), FLAGS_rank,
              lora.params.size(), bytes / 1048576.0, FLAGS_tp,
              share_bytes / 1048576.0);
  std::printf("  single-thread memcpy of the adapter: %.3f ms (%.2f GB/s)\n",
              bytes / memcpy_bw * 1e3, memcpy_bw / 1e9);
  std::printf("  adapter version, begin .. committed: median %.3f ms, p90 "
              "%.3f ms, min %.3f ms, max %.3f ms (%zu versions after %d "
              "warm-up)\n",
              Median(times) * 1e3, times[times.size() * 9 / 10] * 1e3,
              times.front() * 1e3, times.back() * 1e3, times.size(),
              FLAGS_warmup);
  std::printf("  (target: under 5 ms; the last version's bytes checked "
              "against the trainer's)\n");
  for (auto& r : ranks) r->client.reset();
  lora_source->reset();
  base_source->reset();
  return 0;
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  gflags::SetUsageMessage("one LoRA adapter version on one node");
  ferry::ParseFlagsWithOwnHelp(&argc, &argv, __FILE__);
  FLAGS_logtostderr = true;
  FLAGS_minloglevel = 1;
  google::InitGoogleLogging(argv[0]);
  return ferry::Main();
}
