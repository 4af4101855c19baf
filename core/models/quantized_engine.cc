#include "core/models/quantized_engine.h"

#include <map>
#include <set>
#include <string>
#include <utility>

#include "core/fp8_targets.h"

namespace ferry {

ModelSpec TrainerOf(const ModelSpec& fp8_checkpoint, DType dtype) {
  std::set<std::string> scales;
  for (const ParamSpec& p : fp8_checkpoint.params) {
    if (IsFp8Format(p.dtype)) scales.insert(p.name + "_scale_inv");
  }
  ModelSpec out;
  for (const ParamSpec& p : fp8_checkpoint.params) {
    if (scales.count(p.name) > 0) continue;
    ParamSpec q = p;
    if (IsFp8Format(q.dtype)) q.dtype = dtype;
    out.params.push_back(std::move(q));
  }
  out.BuildIndex();
  return out;
}

int64_t DeclareQuantizedInFlight(int64_t block,
                                 std::vector<EngineTable>* tables) {
  int64_t declared = 0;
  for (EngineTable& t : *tables) {
    std::map<std::string, size_t> index;
    for (size_t i = 0; i < t.params.size(); ++i) index[t.params[i].name] = i;
    for (EngineParam& p : t.params) {
      if (!IsFp8Format(p.dtype)) continue;
      auto scale = index.find(p.name + "_scale_inv");
      if (scale == index.end()) continue;
      p.fp8.scale = scale->first;
      p.fp8.block_rows = block;
      p.fp8.block_cols = block;
      EngineParam& s = t.params[scale->second];
      s.loader = LoaderKind::kCustom;
      s.consumes.clear();
      s.parts = FusedParts();
      s.flags = kFlagNone;
      ++declared;
    }
  }
  return declared;
}

}  // namespace ferry
