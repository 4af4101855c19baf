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
#include "core/models/config_model.h"
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

}  // namespace

extern "C" {

// {"tables": [per TP rank: {"tp_rank", "buffer_bytes", "params": [...]}],
//  "checkpoint": [{"name", "dtype", "shape"}]}, or {"error": "..."}.
// The caller frees the string with ferry_free.
char* ferry_vllm_tables_json(const char* config_json, int tp, int expert_parallel) {
  nlohmann::json out;
  ferry::EngineParallelism p;
  p.tp = tp;
  p.expert_parallel = expert_parallel != 0;
  ferry::ModelSpec spec;
  absl::StatusOr<std::vector<ferry::EngineTable>> tables =
      tp < 1 ? absl::InvalidArgumentError(absl::StrCat("tp_size ", tp, " must be >= 1"))
             : ferry::VllmTablesFromConfig(config_json == nullptr ? "" : config_json,
                                           p, &spec);
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
