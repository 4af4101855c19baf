#include "tools/model_args.h"

#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace ferry {
namespace {

// Splits "a=1,b=2,c" into (key, value) pairs; value "" for bare words.
absl::StatusOr<std::vector<std::pair<std::string, std::string>>> Pairs(
    const std::string& spec) {
  std::vector<std::pair<std::string, std::string>> out;
  for (absl::string_view part : absl::StrSplit(spec, ',', absl::SkipEmpty())) {
    std::vector<std::string> kv = absl::StrSplit(part, absl::MaxSplits('=', 1));
    out.emplace_back(kv[0], kv.size() > 1 ? kv[1] : "");
  }
  return out;
}

absl::Status ParseInt(const std::string& key, const std::string& value,
                      int* out) {
  if (!absl::SimpleAtoi(value, out) || *out <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", key, "=", value, "': expected a positive integer"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<TrainerParallelism> ParseTrainerSpec(const std::string& spec) {
  auto pairs = Pairs(spec);
  if (!pairs.ok()) return pairs.status();
  TrainerParallelism p;
  for (const auto& [k, v] : *pairs) {
    absl::Status s;
    if (k == "tp") s = ParseInt(k, v, &p.tp);
    else if (k == "pp") s = ParseInt(k, v, &p.pp);
    else if (k == "dp") s = ParseInt(k, v, &p.dp);
    else if (k == "ep") s = ParseInt(k, v, &p.ep);
    else if (k == "fsdp") p.fsdp = true;
    else if (k == "fused_qkv") p.fused_qkv = true;
    else
      return absl::InvalidArgumentError(absl::StrCat(
          "unknown trainer setting '", k, "' (known: tp pp dp ep fsdp fused_qkv)"));
    if (!s.ok()) return s;
  }
  return p;
}

absl::StatusOr<EngineParallelism> ParseEngineSpec(const std::string& spec) {
  auto pairs = Pairs(spec);
  if (!pairs.ok()) return pairs.status();
  EngineParallelism p;
  for (const auto& [k, v] : *pairs) {
    absl::Status s;
    if (k == "tp") s = ParseInt(k, v, &p.tp);
    else if (k == "ep") p.expert_parallel = true;
    else
      return absl::InvalidArgumentError(
          absl::StrCat("unknown engine setting '", k, "' (known: tp ep)"));
    if (!s.ok()) return s;
  }
  return p;
}

absl::StatusOr<ModelSchema> FirstLayers(const ModelSchema& schema,
                                        int64_t layers) {
  if (layers < 1 || layers > schema.config.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("--layers=", layers, ": ", schema.name, " has ",
                     schema.config.num_layers, " layers"));
  }
  ModelSchema out;
  out.name = schema.name;
  out.config = schema.config;
  out.config.num_layers = layers;
  const std::string prefix = "model.layers.";
  for (const ParamSpec& p : schema.spec.params) {
    if (p.name.compare(0, prefix.size(), prefix) == 0) {
      int64_t layer = 0;
      const size_t dot = p.name.find('.', prefix.size());
      if (absl::SimpleAtoi(p.name.substr(prefix.size(), dot - prefix.size()),
                           &layer) &&
          layer >= layers) {
        continue;
      }
    }
    out.spec.params.push_back(p);
  }
  out.spec.BuildIndex();
  return out;
}

}  // namespace ferry
