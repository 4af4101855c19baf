#include "tools/quantized_trainer.h"

#include <map>
#include <set>

#include "absl/strings/match.h"
#include "core/fp8_targets.h"
#include "core/region_copy.h"

namespace ferry {

ModelSpec Bf16TrainerOf(const ModelSpec& fp8_checkpoint) {
  std::set<std::string> scales;
  for (const ParamSpec& p : fp8_checkpoint.params) {
    if (IsFp8Format(p.dtype)) scales.insert(p.name + "_scale_inv");
  }
  ModelSpec out;
  for (const ParamSpec& p : fp8_checkpoint.params) {
    if (scales.count(p.name) > 0) continue;
    ParamSpec q = p;
    if (IsFp8Format(q.dtype)) q.dtype = DType::kBF16;
    out.params.push_back(std::move(q));
  }
  out.BuildIndex();
  return out;
}

std::vector<std::string> DeclareQuantizedInFlight(
    int64_t block, std::vector<EngineTable>* tables) {
  std::set<std::string> transformed;
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
      if (p.flags & kFlagTransformed) {
        transformed.insert(p.name);
        p.flags &= ~kFlagTransformed;
      }
      EngineParam& s = t.params[scale->second];
      s.loader = LoaderKind::kCustom;
      s.consumes.clear();
      s.parts = FusedParts();
      s.flags = kFlagNone;
    }
  }
  return {transformed.begin(), transformed.end()};
}

void SpreadOverTrainerGpus(size_t trainer_ranks, Fp8Sources* fs,
                           std::vector<int>* gpu_of) {
  fs->sources.resize(trainer_ranks);
  gpu_of->assign(trainer_ranks, -1);
  std::map<std::string, std::vector<int>> on_node;  // trainer ranks
  for (size_t r = 0; r < trainer_ranks; ++r) {
    on_node[fs->sources[r].node].push_back(static_cast<int>(r));
  }
  std::vector<int64_t> load(trainer_ranks, 0);
  std::map<int, int32_t> split_of;  // trainer rank -> its quantizer rank
  for (QuantizedParam& q : fs->quantized) {
    const std::vector<int>& ranks = on_node[q.node];
    int host = ranks.front();
    for (int r : ranks) {
      if (load[r] < load[host]) host = r;
    }
    const ParamSpec& fp8 = fs->model.params[q.fp8_param];
    const ParamSpec& scales = fs->model.params[q.scale_param];
    load[host] += BoxBytes(FullBox(fp8.shape), fp8.dtype);
    auto [it, fresh] = split_of.emplace(
        host, static_cast<int32_t>(fs->sources.size()));
    if (fresh) {
      RankLayout rank;
      rank.rank = it->second;
      rank.node = q.node;
      rank.buffer_bytes = {0, 0};
      fs->sources.push_back(std::move(rank));
      gpu_of->push_back(host);
    }
    RankLayout& rank = fs->sources[it->second];
    q.source_rank = it->second;
    q.fp8_offset = rank.buffer_bytes[0];
    q.scale_offset = rank.buffer_bytes[1];
    rank.pieces.push_back(Piece::Contiguous(q.fp8_param, FullBox(fp8.shape), 0,
                                            q.fp8_offset, fp8.dtype));
    rank.pieces.push_back(Piece::Contiguous(q.scale_param,
                                            FullBox(scales.shape), 1,
                                            q.scale_offset, DType::kF32));
    rank.buffer_bytes[0] += BoxBytes(FullBox(fp8.shape), fp8.dtype);
    rank.buffer_bytes[1] += BoxBytes(FullBox(scales.shape), DType::kF32);
  }
}

}  // namespace ferry
