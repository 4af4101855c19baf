#include "tools/quantizer_gpus.h"

#include <algorithm>
#include <map>
#include <string>
#include <utility>

#include "core/region_copy.h"

namespace ferry {

void SpreadOverTrainerGpus(size_t trainer_ranks, Fp8Sources* fs,
                           std::vector<int>* gpu_of) {
  fs->sources.resize(trainer_ranks);
  gpu_of->assign(trainer_ranks, -1);
  std::map<std::string, std::vector<int>> on_node;  // trainer ranks
  for (size_t r = 0; r < trainer_ranks; ++r) {
    on_node[fs->sources[r].node].push_back(static_cast<int>(r));
  }
  std::map<int, int32_t> split_of;  // trainer rank -> its quantizer rank
  std::map<std::string, size_t> next;  // node -> the GPU a tensor starts on
  // Appends box `rows` of q's FP8 tensor and box `scale_rows` of its
  // scales (either may be empty) to the quantizer rank on trainer rank
  // `host`'s GPU.
  auto place_boxes = [&](int host, const QuantizedParam& q, const Box& rows,
                         const Box& scale_rows) {
    auto [it, fresh] =
        split_of.emplace(host, static_cast<int32_t>(fs->sources.size()));
    if (fresh) {
      RankLayout rank;
      rank.rank = it->second;
      rank.node = fs->sources[host].node;
      rank.buffer_bytes = {0, 0};
      fs->sources.push_back(std::move(rank));
      gpu_of->push_back(host);
    }
    RankLayout& rank = fs->sources[it->second];
    const ParamSpec& fp8 = fs->model.params[q.fp8_param];
    if (!rows.extent.empty()) {
      rank.pieces.push_back(Piece::Contiguous(q.fp8_param, rows, 0,
                                              rank.buffer_bytes[0], fp8.dtype));
      rank.buffer_bytes[0] += BoxBytes(rows, fp8.dtype);
    }
    if (!scale_rows.extent.empty()) {
      rank.pieces.push_back(Piece::Contiguous(
          q.scale_param, scale_rows, 1, rank.buffer_bytes[1], DType::kF32));
      rank.buffer_bytes[1] += BoxBytes(scale_rows, DType::kF32);
    }
  };
  // Rows [r0, r1) of q's FP8 tensor and their block rows of its scales.
  auto place = [&](int host, const QuantizedParam& q, int64_t r0, int64_t r1) {
    const ParamSpec& fp8 = fs->model.params[q.fp8_param];
    const ParamSpec& scales = fs->model.params[q.scale_param];
    const int64_t s0 = r0 / q.block_rows;
    const int64_t s1 = (r1 + q.block_rows - 1) / q.block_rows;
    place_boxes(host, q, Box{{r0, 0}, {r1 - r0, fp8.shape[1]}},
                Box{{s0, 0}, {s1 - s0, scales.shape[1]}});
  };
  // The next GPU of `node` a tensor starts on.
  auto next_gpu = [&](const std::string& node) {
    const std::vector<int>& ranks = on_node[node];
    return ranks[next[node]++ % ranks.size()];
  };
  for (QuantizedParam& q : fs->quantized) {
    if (q.split()) {
      // Each part on a GPU of the node that holds it, the scales on one
      // of q.node's (FSDP over nodes: each part is a rank's flat shard).
      for (const QuantizedPart& part : q.parts) {
        place_boxes(next_gpu(part.node), q, part.box, Box{});
      }
      place_boxes(next_gpu(q.node), q, Box{},
                  FullBox(fs->model.params[q.scale_param].shape));
      q.source_rank = -1;
      continue;
    }
    // Each tensor in whole block rows over the node's GPUs, as a TP
    // shard would be (a tensor read whole by many ranks, as a fallback
    // is, then leaves through every NIC), starting where the last ended.
    const std::vector<int>& ranks = on_node[q.node];
    const int64_t rows = fs->model.params[q.fp8_param].shape[0];
    const int64_t blocks = (rows + q.block_rows - 1) / q.block_rows;
    const int64_t k = std::min<int64_t>(static_cast<int64_t>(ranks.size()), blocks);
    size_t& start = next[q.node];
    for (int64_t i = 0; i < k; ++i) {
      const int64_t r0 = blocks * i / k * q.block_rows;
      const int64_t r1 = std::min(rows, blocks * (i + 1) / k * q.block_rows);
      place(ranks[(start + i) % ranks.size()], q, r0, r1);
    }
    start = (start + k) % ranks.size();
    q.source_rank = -1;  // split over those ranks
  }
}

}  // namespace ferry
