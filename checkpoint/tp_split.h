// How each tensor of a checkpoint file splits across the TP ranks of an
// engine, as vLLM shards weights (and GGUF-quantized weights, seed 001):
//
//   outer       column-parallel weights (q, k, v, gate, up, the embedding,
//               the output head, their biases): whole rows (output
//               features, GGUF ne[1]) per rank; contiguous in the file.
//   inner       row-parallel weights (attn_output / o_proj, ffn_down /
//               down_proj): the innermost dim (GGUF ne[0]) split per rank,
//               only on whole quantization blocks; one byte range per row.
//   replicated  norms, the MoE router, anything 1-D that is not a bias of
//               a column-parallel weight, and k/v when the TP size exceeds
//               the key/value heads: each rank a whole head (vLLM
//               replicates kv heads), or the whole tensor.
//   fallback    a split that would fall inside a block, or rows that do not
//               divide by the TP size: the engine's loader takes the whole
//               tensor (the reason says which).
//
// GGUF names (token_embd, blk.N.attn_q, ffn_gate_exps, ...) are mapped to
// the Hugging Face names engines declare, as vLLM's GGUF loader maps them;
// safetensors names are Hugging Face names already.
//
// Pure; any thread.
#ifndef FERRY_CHECKPOINT_TP_SPLIT_H_
#define FERRY_CHECKPOINT_TP_SPLIT_H_

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "checkpoint/checkpoint.h"

namespace ferry {

enum class SplitKind { kOuter, kInner, kReplicated, kFallback };
const char* SplitKindName(SplitKind kind);  // "outer", "inner", ...

struct RankRanges {
  int32_t rank = 0;
  // Absolute byte ranges [start, end) of the file this rank reads, in
  // order, adjacent ones merged.
  std::vector<std::pair<int64_t, int64_t>> byte_ranges;
};

struct TensorSplit {
  std::string file_name;  // as the file names it
  std::string name;       // the engine's (Hugging Face) name
  std::string type;       // "Q4_K", "BF16"
  SplitKind split = SplitKind::kReplicated;
  std::string reason;     // why fallback (or replicated kv); else empty
  int32_t file = 0;       // index into Checkpoint::files
  std::string data_file;  // that file's path: the byte ranges are in it
  std::vector<RankRanges> ranks;  // by rank; empty for fallback
};

struct SplitOptions {
  int32_t tp = 1;
  // Key/value heads of the model (GGUF `<arch>.attention.head_count_kv`);
  // 0: read from the GGUF metadata, else k/v split like q.
  int32_t kv_heads = 0;
};

// "blk.3.attn_q.weight" -> "model.layers.3.self_attn.q_proj.weight"; a
// name that is not a GGUF name comes back unchanged.
std::string HfNameOfGguf(const std::string& gguf_name);

// Every tensor of `c`, split for `options.tp` ranks. INVALID_ARGUMENT for a
// TP size below 1.
absl::StatusOr<std::vector<TensorSplit>> PlanTpSplits(
    const Checkpoint& c, const SplitOptions& options);

// The explain output: a table for a person, or the JSON form
// {"file", "tp", "tensors": [{"file_name", "name", "type", "split",
// "reason", "ranks": [{"rank", "byte_ranges": [[start, end], ...]}]}]}.
std::string FormatTpSplits(const std::string& file, int32_t tp,
                           const std::vector<TensorSplit>& splits);
std::string TpSplitsJson(const std::string& file, int32_t tp,
                         const std::vector<TensorSplit>& splits);

}  // namespace ferry

#endif  // FERRY_CHECKPOINT_TP_SPLIT_H_
