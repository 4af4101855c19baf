// The C ABI behind ferry.vllm_table (python/ferry/tables.py, via ctypes):
// vLLM's engine tables for a config.json, built by core/models (the code the
// daemon's tests and benchmarks use), returned as JSON. A shared library so
// that the Python client needs no extension build and no daemon to ask.
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/dtype.h"
#include "core/fp8_targets.h"
#include "core/models/config_model.h"
#include "core/models/quantized_engine.h"
#include "nlohmann/json.hpp"

namespace {

const char* LoaderName(ferry::LoaderKind k) {
  switch (k) {
    case ferry::LoaderKind::kReplicated:
      return "replicated";
    case ferry::LoaderKind::kColumn:
      return "column";
    case ferry::LoaderKind::kRow:
      return "row";
    case ferry::LoaderKind::kVocabParallel:
      return "vocab_parallel";
    case ferry::LoaderKind::kFused:
      return "fused";
    case ferry::LoaderKind::kCustom:
      break;
  }
  return "custom";
}

std::vector<int64_t> Vec(const ferry::Dims& d) { return {d.begin(), d.end()}; }

char* Copy(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// The config's quantization_config.weight_block_size (its rows; vLLM's
// block-scaled FP8 models use square blocks), 128 when it names none.
int64_t BlockOf(const char* config_json) {
  const nlohmann::json c = nlohmann::json::parse(
      config_json == nullptr ? "" : config_json, nullptr, false);
  if (!c.is_object() || !c.contains("quantization_config")) return 128;
  const nlohmann::json& q = c["quantization_config"];
  if (!q.is_object() || !q.contains("weight_block_size")) return 128;
  const nlohmann::json& b = q["weight_block_size"];
  if (!b.is_array() || b.empty() || !b[0].is_number_integer()) return 128;
  return b[0].get<int64_t>();
}

}  // namespace

extern "C" {

// {"tables": [per TP rank: {"tp_rank", "buffer_bytes", "params": [...]}],
//  "checkpoint": [{"name", "dtype", "shape"}]}, or {"error": "..."}.
// `trainer_dtype` "" (the checkpoint as it is) or "bf16" / "f16" / "f32":
// an FP8 block-scaled model whose trainer holds it in that dtype, every
// FP8 weight declared quantized in flight ("fp8" in its entry) and the
// checkpoint listed as the trainer holds it (core/models/quantized_engine.h).
// The caller frees the string with ferry_free.
char* ferry_vllm_tables_json(const char* config_json, int tp, int expert_parallel,
                             const char* trainer_dtype) {
  nlohmann::json out;
  ferry::EngineParallelism p;
  p.tp = tp;
  p.expert_parallel = expert_parallel != 0;
  ferry::ModelSpec spec;
  absl::StatusOr<std::vector<ferry::EngineTable>> tables =
      tp < 1 ? absl::InvalidArgumentError(absl::StrCat("tp_size ", tp, " must be >= 1"))
             : ferry::VllmTablesFromConfig(config_json == nullptr ? "" : config_json,
                                           p, &spec);
  const std::string trainer = trainer_dtype == nullptr ? "" : trainer_dtype;
  if (tables.ok() && !trainer.empty()) {
    const absl::StatusOr<ferry::DType> d = ferry::ParseDType(trainer);
    if (!d.ok() || !ferry::IsFp8Source(*d)) {
      tables = absl::InvalidArgumentError(absl::StrCat(
          "trainer_dtype \"", trainer, "\": FP8 in flight quantizes bf16, f16 "
          "or f32"));
    } else if (ferry::DeclareQuantizedInFlight(BlockOf(config_json), &*tables) ==
               0) {
      tables = absl::InvalidArgumentError(absl::StrCat(
          "trainer_dtype \"", trainer, "\": the config has no FP8 "
          "block-scaled weights to quantize in flight (its "
          "quantization_config.weight_block_size is unset)"));
    } else {
      spec = ferry::TrainerOf(spec, *d);
    }
  }
  if (!tables.ok()) {
    out["error"] = std::string(tables.status().message());
    return Copy(out.dump());
  }
  out["tables"] = nlohmann::json::array();
  for (const ferry::EngineTable& t : *tables) {
    nlohmann::json table;
    table["tp_rank"] = t.tp_rank;
    table["buffer_bytes"] = t.buffer_bytes.empty() ? 0 : t.buffer_bytes[0];
    table["params"] = nlohmann::json::array();
    for (const ferry::EngineParam& e : t.params) {
      nlohmann::json j;
      j["name"] = e.name;
      j["dtype"] = ferry::DTypeName(e.dtype);
      j["shape"] = Vec(e.local_shape);
      j["byte_offset"] = e.byte_offset;
      j["loader"] = LoaderName(e.loader);
      j["shard_dim"] = e.shard_dim;
      j["flags"] = e.flags;
      j["consumes"] = e.consumes;
      j["alias_of"] = e.alias_of;
      if (e.fp8.declared()) {
        j["fp8"] = {{"scale", e.fp8.scale},
                    {"block_rows", e.fp8.block_rows},
                    {"block_cols", e.fp8.block_cols}};
      }
      j["parts"] = nlohmann::json::array();
      for (const ferry::FusedPart& f : e.parts) {
        j["parts"].push_back({{"checkpoint_name", f.checkpoint_name},
                              {"lead_index", Vec(f.lead_index)},
                              {"local_extent", f.local_extent}});
      }
      table["params"].push_back(std::move(j));
    }
    out["tables"].push_back(std::move(table));
  }
  out["checkpoint"] = nlohmann::json::array();
  for (const ferry::ParamSpec& s : spec.params) {
    out["checkpoint"].push_back(
        {{"name", s.name}, {"dtype", ferry::DTypeName(s.dtype)}, {"shape", Vec(s.shape)}});
  }
  return Copy(out.dump());
}

void ferry_free(char* p) { std::free(p); }

}  // extern "C"
