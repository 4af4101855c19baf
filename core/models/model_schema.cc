#include "core/models/model_schema.h"

#include <algorithm>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "core/checked_math.h"
#include "core/models/models_dir.h"

namespace ferry {
namespace {

using nlohmann::json;

// Reads fields of one JSON file and turns every mistake into a Status that
// names the file and the field. nlohmann's typed getters throw; these
// helpers check the type first so that nothing throws past them.
class FieldReader {
 public:
  explicit FieldReader(std::string path) : path_(std::move(path)) {}

  absl::Status Error(absl::string_view field, absl::string_view what) const {
    return absl::InvalidArgumentError(
        absl::StrCat(path_, ": field '", field, "': ", what));
  }

  // An integer field; a missing or null one is `fallback`.
  absl::StatusOr<int64_t> Int(const json& obj, const char* key,
                              absl::string_view where,
                              int64_t fallback = 0) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return fallback;
    if (!it->is_number_integer()) {
      return Error(absl::StrCat(where, key), "expected an integer");
    }
    return it->get<int64_t>();
  }

  absl::StatusOr<std::string> String(const json& obj, const char* key,
                                     absl::string_view where) const {
    auto it = obj.find(key);
    if (it == obj.end() || !it->is_string()) {
      return Error(absl::StrCat(where, key), "expected a string");
    }
    return it->get<std::string>();
  }

  absl::StatusOr<bool> Bool(const json& obj, const char* key,
                            absl::string_view where) const {
    auto it = obj.find(key);
    if (it == obj.end() || it->is_null()) return false;
    if (!it->is_boolean()) {
      return Error(absl::StrCat(where, key), "expected true or false");
    }
    return it->get<bool>();
  }

 private:
  std::string path_;
};

// One entry of `tensors`: a name with {L}/{E} placeholders.
struct TensorTemplate {
  std::string name;
  DType dtype = DType::kInvalid;
  Dims shape;
  std::string layer_group;  // empty: occurs once
  int64_t experts = 0;      // 0: not per expert
  int64_t instances = -1;   // declared count after expansion, -1 if absent
};

struct LayerRange {
  int64_t start = 0;
  int64_t stop = 0;
  bool Contains(int64_t layer) const { return layer >= start && layer < stop; }
};

// The shape-deciding fields of a config.json object `c`; `prefix` is how
// error messages name the object ("config." in a schema file, "" for a
// config.json itself).
absl::StatusOr<ModelConfig> ParseConfigObject(const FieldReader& r,
                                              const json& c,
                                              const std::string& prefix) {
  ModelConfig cfg;
  struct IntField {
    const char* key;
    int64_t* out;
  };
  const IntField fields[] = {
      {"hidden_size", &cfg.hidden_size},
      {"intermediate_size", &cfg.intermediate_size},
      {"moe_intermediate_size", &cfg.moe_intermediate_size},
      {"num_hidden_layers", &cfg.num_layers},
      {"num_attention_heads", &cfg.num_attention_heads},
      {"num_key_value_heads", &cfg.num_kv_heads},
      {"head_dim", &cfg.head_dim},
      {"vocab_size", &cfg.vocab_size},
      {"num_experts", &cfg.num_experts},
      {"n_shared_experts", &cfg.num_shared_experts},
      {"first_k_dense_replace", &cfg.first_k_dense_replace},
      {"q_lora_rank", &cfg.q_lora_rank},
      {"kv_lora_rank", &cfg.kv_lora_rank},
      {"qk_nope_head_dim", &cfg.qk_nope_head_dim},
      {"qk_rope_head_dim", &cfg.qk_rope_head_dim},
      {"v_head_dim", &cfg.v_head_dim},
  };
  for (const IntField& f : fields) {
    auto v = r.Int(c, f.key, prefix);
    if (!v.ok()) return v.status();
    if (*v < 0) return r.Error(absl::StrCat(prefix, f.key), "is negative");
    *f.out = *v;
  }
  // DeepSeek names the routed-expert count differently from Qwen.
  if (cfg.num_experts == 0) {
    auto v = r.Int(c, "n_routed_experts", prefix);
    if (!v.ok()) return v.status();
    cfg.num_experts = *v;
  }
  auto tie = r.Bool(c, "tie_word_embeddings", prefix);
  if (!tie.ok()) return tie.status();
  cfg.tie_word_embeddings = *tie;
  if (cfg.head_dim == 0 && !cfg.is_mla() && cfg.num_attention_heads > 0) {
    cfg.head_dim = cfg.hidden_size / cfg.num_attention_heads;
  }
  if (auto q = c.find("quantization_config"); q != c.end() && q->is_object()) {
    auto block = q->find("weight_block_size");
    if (block != q->end()) {
      if (!block->is_array() || block->empty() ||
          !(*block)[0].is_number_integer() || (*block)[0].get<int64_t>() <= 0) {
        return r.Error(absl::StrCat(prefix, "quantization_config.weight_block_size"),
                       "expected a list of positive integers");
      }
      cfg.fp8_block = (*block)[0].get<int64_t>();
    }
  }
  auto sparse_step = r.Int(c, "decoder_sparse_step", prefix, 1);
  if (!sparse_step.ok()) return sparse_step.status();
  cfg.decoder_sparse_step = std::max<int64_t>(*sparse_step, 1);
  if (auto m = c.find("mlp_only_layers"); m != c.end() && !m->is_null()) {
    if (!m->is_array()) {
      return r.Error(absl::StrCat(prefix, "mlp_only_layers"),
                     "expected a list of layer indices");
    }
    for (const json& l : *m) {
      if (!l.is_number_integer()) {
        return r.Error(absl::StrCat(prefix, "mlp_only_layers"),
                       "expected a list of layer indices");
      }
      cfg.mlp_only_layers.push_back(l.get<int64_t>());
    }
  }
  if (auto d = c.find("torch_dtype"); d != c.end() && d->is_string()) {
    cfg.torch_dtype = d->get<std::string>();
  }
  return cfg;
}

absl::StatusOr<ModelConfig> ParseConfig(const FieldReader& r, const json& doc) {
  auto cfg_it = doc.find("config");
  if (cfg_it == doc.end() || !cfg_it->is_object()) {
    return r.Error("config", "expected an object");
  }
  absl::StatusOr<ModelConfig> cfg = ParseConfigObject(r, *cfg_it, "config.");
  if (!cfg.ok()) return cfg.status();
  if (auto it = doc.find("architecture"); it != doc.end() && it->is_string()) {
    cfg->architecture = it->get<std::string>();
  }
  return cfg;
}

absl::StatusOr<std::map<std::string, LayerRange>> ParseLayerGroups(
    const FieldReader& r, const json& doc) {
  std::map<std::string, LayerRange> groups;
  auto exp = doc.find("expansion");
  if (exp == doc.end()) return groups;  // a model without layered tensors
  auto lg = exp->find("layer_groups");
  if (lg == exp->end() || !lg->is_object()) {
    return r.Error("expansion.layer_groups", "expected an object");
  }
  for (auto it = lg->begin(); it != lg->end(); ++it) {
    const std::string where = absl::StrCat("expansion.layer_groups.", it.key());
    if (!it->is_object()) return r.Error(where, "expected an object");
    auto start = r.Int(*it, "start", where + ".", -1);
    if (!start.ok()) return start.status();
    auto stop = r.Int(*it, "stop", where + ".", -1);
    if (!stop.ok()) return stop.status();
    if (*start < 0 || *stop < *start) {
      return r.Error(where, "expected 0 <= start <= stop");
    }
    groups[it.key()] = LayerRange{*start, *stop};
  }
  return groups;
}

absl::StatusOr<TensorTemplate> ParseTemplate(
    const FieldReader& r, const json& t, const std::string& where,
    const std::map<std::string, LayerRange>& groups) {
  if (!t.is_object()) return r.Error(where, "expected an object");
  TensorTemplate out;
  auto name = r.String(t, "name", where + ".");
  if (!name.ok()) return name.status();
  out.name = *name;
  const std::string at = absl::StrCat(where, " (", out.name, ").");

  auto dtype_name = r.String(t, "dtype", at);
  if (!dtype_name.ok()) return dtype_name.status();
  auto dtype = ParseDType(*dtype_name);
  if (!dtype.ok()) return r.Error(at + "dtype", dtype.status().message());
  out.dtype = *dtype;

  auto shape = t.find("shape");
  if (shape == t.end() || !shape->is_array()) {
    return r.Error(at + "shape", "expected a list of integers");
  }
  for (const json& d : *shape) {
    if (!d.is_number_integer()) {
      return r.Error(at + "shape", "expected a list of integers");
    }
    out.shape.push_back(d.get<int64_t>());
  }
  if (absl::Status s = ValidateShape(out.shape, UnitBytes(out.dtype));
      !s.ok()) {
    return r.Error(at + "shape", s.message());
  }
  if (!out.shape.empty() && out.shape.back() % BlockElems(out.dtype) != 0) {
    return r.Error(at + "shape", "last dim is not a whole number of blocks");
  }

  if (auto layers = t.find("layers"); layers != t.end()) {
    if (!layers->is_string() || groups.count(layers->get<std::string>()) == 0) {
      return r.Error(at + "layers",
                     "expected a group of expansion.layer_groups");
    }
    out.layer_group = layers->get<std::string>();
    if (out.name.find("{L}") == std::string::npos) {
      return r.Error(at + "name", "a per-layer tensor needs {L}");
    }
  }
  auto experts = r.Int(t, "experts", at);
  if (!experts.ok()) return experts.status();
  if (*experts < 0) return r.Error(at + "experts", "is negative");
  out.experts = *experts;
  if (out.experts > 0 && out.name.find("{E}") == std::string::npos) {
    return r.Error(at + "name", "a per-expert tensor needs {E}");
  }
  auto instances = r.Int(t, "instances", at, -1);
  if (!instances.ok()) return instances.status();
  out.instances = *instances;
  return out;
}

std::string Substitute(const std::string& name, int64_t layer, int64_t expert) {
  return absl::StrReplaceAll(
      name, {{"{L}", absl::StrCat(layer)}, {"{E}", absl::StrCat(expert)}});
}

void Emit(const TensorTemplate& t, int64_t layer, int64_t expert,
          ModelSpec* spec) {
  spec->params.push_back(
      ParamSpec{Substitute(t.name, layer, expert), t.dtype, t.shape});
}

// Expands a run of per-layer templates layer by layer, as the modules of a
// decoder layer are ordered; consecutive per-expert templates (an expert's
// gate/up/down and their scales) are expanded expert by expert.
void ExpandLayerBlock(const std::vector<TensorTemplate>& block,
                      const std::map<std::string, LayerRange>& groups,
                      ModelSpec* spec) {
  int64_t first = INT64_MAX, last = 0;
  for (const TensorTemplate& t : block) {
    const LayerRange& g = groups.at(t.layer_group);
    if (g.start < g.stop) {
      first = std::min(first, g.start);
      last = std::max(last, g.stop);
    }
  }
  for (int64_t layer = first; layer < last; ++layer) {
    for (size_t i = 0; i < block.size();) {
      size_t run_end = i + 1;
      if (block[i].experts > 0) {
        while (run_end < block.size() &&
               block[run_end].experts == block[i].experts) {
          ++run_end;
        }
      }
      const int64_t experts = std::max<int64_t>(block[i].experts, 1);
      for (int64_t e = 0; e < experts; ++e) {
        for (size_t k = i; k < run_end; ++k) {
          if (groups.at(block[k].layer_group).Contains(layer)) {
            Emit(block[k], layer, e, spec);
          }
        }
      }
      i = run_end;
    }
  }
}

// Expands templates in order: maximal runs of per-layer templates go layer
// by layer, templates without layers occur once where they stand.
void ExpandTemplates(const std::vector<TensorTemplate>& templates,
                     const std::map<std::string, LayerRange>& groups,
                     ModelSpec* spec) {
  for (size_t i = 0; i < templates.size();) {
    if (templates[i].layer_group.empty()) {
      const int64_t experts = std::max<int64_t>(templates[i].experts, 1);
      for (int64_t e = 0; e < experts; ++e) Emit(templates[i], 0, e, spec);
      ++i;
      continue;
    }
    size_t end = i;
    while (end < templates.size() && !templates[end].layer_group.empty()) {
      ++end;
    }
    ExpandLayerBlock({templates.begin() + i, templates.begin() + end}, groups,
                     spec);
    i = end;
  }
}

// The count a template expands to, for the `instances` cross-check.
int64_t InstanceCount(const TensorTemplate& t,
                      const std::map<std::string, LayerRange>& groups) {
  int64_t n = std::max<int64_t>(t.experts, 1);
  if (!t.layer_group.empty()) {
    const LayerRange& g = groups.at(t.layer_group);
    n *= g.stop - g.start;
  }
  return n;
}

absl::Status ParseTemplateList(const FieldReader& r, const json& doc,
                               const char* key,
                               const std::map<std::string, LayerRange>& groups,
                               std::vector<TensorTemplate>* out) {
  auto list = doc.find(key);
  if (list == doc.end() || !list->is_array()) {
    return r.Error(key, "expected a list of tensors");
  }
  for (size_t i = 0; i < list->size(); ++i) {
    const std::string where = absl::StrCat(key, "[", i, "]");
    auto t = ParseTemplate(r, (*list)[i], where, groups);
    if (!t.ok()) return t.status();
    if (t->instances >= 0 && t->instances != InstanceCount(*t, groups)) {
      return r.Error(absl::StrCat(where, " (", t->name, ").instances"),
                     absl::StrCat("declares ", t->instances, " but expands to ",
                                  InstanceCount(*t, groups)));
    }
    out->push_back(std::move(*t));
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelSchema> ParseSchema(const std::string& path,
                                        const json& doc,
                                        const SchemaOptions& options) {
  const FieldReader r(path);
  if (!doc.is_object()) return r.Error("(top level)", "expected an object");
  ModelSchema schema;
  if (auto it = doc.find("name"); it != doc.end() && it->is_string()) {
    schema.name = it->get<std::string>();
  }
  auto config = ParseConfig(r, doc);
  if (!config.ok()) return config.status();
  schema.config = std::move(*config);
  auto groups = ParseLayerGroups(r, doc);
  if (!groups.ok()) return groups.status();

  std::vector<TensorTemplate> templates;
  if (absl::Status s =
          ParseTemplateList(r, doc, "tensors", *groups, &templates);
      !s.ok()) {
    return s;
  }
  if (options.include_mtp && doc.contains("mtp_tensors")) {
    if (absl::Status s =
            ParseTemplateList(r, doc, "mtp_tensors", *groups, &templates);
        !s.ok()) {
      return s;
    }
  }
  ExpandTemplates(templates, *groups, &schema.spec);
  schema.spec.BuildIndex();

  // Two templates that expand to one name would make Find() ambiguous.
  std::vector<std::string> names;
  names.reserve(schema.spec.params.size());
  for (const ParamSpec& p : schema.spec.params) names.push_back(p.name);
  std::sort(names.begin(), names.end());
  auto dup = std::adjacent_find(names.begin(), names.end());
  if (dup != names.end()) {
    return r.Error("tensors", absl::StrCat("duplicate tensor ", *dup));
  }

  auto num_tensors = r.Int(doc, "num_tensors", "", -1);
  if (!num_tensors.ok()) return num_tensors.status();
  schema.declared_num_tensors = *num_tensors;
  auto total_bytes = r.Int(doc, "total_bytes", "", -1);
  if (!total_bytes.ok()) return total_bytes.status();
  schema.declared_total_bytes = *total_bytes;
  return schema;
}

}  // namespace

int64_t ParamBytes(const ParamSpec& param) {
  return Volume(StorageShape(param.shape, param.dtype)) *
         UnitBytes(param.dtype);
}

int64_t TotalBytes(const ModelSpec& spec) {
  int64_t total = 0;
  for (const ParamSpec& p : spec.params) total += ParamBytes(p);
  return total;
}

absl::StatusOr<ModelSchema> LoadModelSchema(const std::string& path,
                                            const SchemaOptions& options) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  }
  std::stringstream text;
  text << in.rdbuf();
  // nlohmann reports errors by throwing; this is the one place that can
  // throw, so the exception stops here and becomes a Status.
  try {
    const json doc = json::parse(text.str());
    return ParseSchema(path, doc, options);
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not valid JSON: ", e.what()));
  }
}

absl::StatusOr<ModelSchema> LoadNamedModelSchema(absl::string_view name,
                                                 const SchemaOptions& options) {
  auto dir = FindModelsDir();
  if (!dir.ok()) return dir.status();
  return LoadModelSchema(absl::StrCat(*dir, "/", name, ".json"), options);
}

absl::StatusOr<ModelConfig> ParseHfConfig(absl::string_view json_text,
                                          const std::string& where) {
  const FieldReader r(where);
  json doc = json::parse(json_text.begin(), json_text.end(), nullptr,
                         /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) {
    return r.Error("(top level)", "not a JSON object");
  }
  absl::StatusOr<ModelConfig> cfg = ParseConfigObject(r, doc, "");
  if (!cfg.ok()) return cfg.status();
  auto arch = doc.find("architectures");
  if (arch == doc.end() || !arch->is_array() || arch->empty() ||
      !(*arch)[0].is_string()) {
    return r.Error("architectures", "expected a list with the model class name");
  }
  cfg->architecture = (*arch)[0].get<std::string>();
  return cfg;
}

}  // namespace ferry
