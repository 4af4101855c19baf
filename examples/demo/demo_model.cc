#include "examples/demo/demo_model.h"

#include "absl/strings/str_cat.h"
#include "core/models/scaled_model.h"

namespace ferry {

absl::StatusOr<ModelSchema> LoadDemoModel(const std::string& model_name,
                                          const std::string& scale) {
  absl::StatusOr<ModelSchema> base = LoadNamedModelSchema(model_name);
  if (!base.ok()) return base.status();
  if (scale == "full") return base;
  ModelScale s;
  if (scale == "demo") {
    s = DemoScale();
  } else if (scale == "small" || scale == "tiny") {
    s.num_layers = scale == "tiny" ? 1 : 2;
    s.hidden_size = 256;
    s.intermediate_size = 512;
    s.num_attention_heads = 8;
    s.num_kv_heads = 4;
    s.head_dim = 32;
    s.vocab_size = scale == "tiny" ? 512 : 4096;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "unknown --scale '", scale, "' (demo, small, tiny or full)"));
  }
  return ScaleModel(*base, s);
}

}  // namespace ferry
