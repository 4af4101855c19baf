#include "checkpoint/tp_split.h"

#include <algorithm>
#include <map>

#include <nlohmann/json.hpp>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "core/checked_math.h"

namespace ferry {
namespace {

// GGUF block-level names -> Hugging Face module names (vLLM's GGUF loader).
const std::map<std::string, std::string>& BlockNames() {
  static const auto* m = new std::map<std::string, std::string>{
      {"attn_norm", "input_layernorm"},
      {"attn_q", "self_attn.q_proj"},
      {"attn_k", "self_attn.k_proj"},
      {"attn_v", "self_attn.v_proj"},
      {"attn_output", "self_attn.o_proj"},
      {"ffn_norm", "post_attention_layernorm"},
      {"ffn_gate", "mlp.gate_proj"},
      {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"},
      {"ffn_gate_inp", "mlp.gate"},
      {"ffn_gate_exps", "mlp.experts.gate_proj"},
      {"ffn_up_exps", "mlp.experts.up_proj"},
      {"ffn_down_exps", "mlp.experts.down_proj"},
  };
  return *m;
}

enum class Role { kColumn, kRow, kReplicated, kKv };

// How a Hugging Face parameter splits, by its module name.
Role RoleOf(const std::string& hf) {
  const bool bias = absl::EndsWith(hf, ".bias");
  for (const char* kv : {".k_proj.", ".v_proj."}) {
    if (absl::StrContains(hf, kv)) return Role::kKv;
  }
  for (const char* col : {".q_proj.", ".gate_proj.", ".up_proj.",
                          "embed_tokens.", "lm_head."}) {
    if (absl::StrContains(hf, col)) return Role::kColumn;
  }
  for (const char* row : {".o_proj.", ".down_proj."}) {
    // A row-parallel weight's bias is added once, after the reduce.
    if (absl::StrContains(hf, row)) return bias ? Role::kReplicated : Role::kRow;
  }
  return Role::kReplicated;
}

void Add(RankRanges* r, int64_t start, int64_t end) {
  if (end <= start) return;
  if (!r->byte_ranges.empty() && r->byte_ranges.back().second == start) {
    r->byte_ranges.back().second = end;
  } else {
    r->byte_ranges.emplace_back(start, end);
  }
}

int32_t KvHeadsOf(const Checkpoint& c) {
  auto arch = c.metadata.find("general.architecture");
  if (arch == c.metadata.end()) return 0;
  auto kv = c.metadata.find(arch->second + ".attention.head_count_kv");
  int32_t n = 0;
  if (kv == c.metadata.end() || !absl::SimpleAtoi(kv->second, &n)) return 0;
  return n;
}

}  // namespace

const char* SplitKindName(SplitKind kind) {
  switch (kind) {
    case SplitKind::kOuter: return "outer";
    case SplitKind::kInner: return "inner";
    case SplitKind::kReplicated: return "replicated";
    case SplitKind::kFallback: return "fallback";
  }
  return "?";
}

std::string HfNameOfGguf(const std::string& g) {
  if (g == "token_embd.weight") return "model.embed_tokens.weight";
  if (g == "output_norm.weight") return "model.norm.weight";
  if (g == "output.weight") return "lm_head.weight";
  const std::vector<std::string> parts = absl::StrSplit(g, '.');
  int layer;
  if (parts.size() == 4 && parts[0] == "blk" && absl::SimpleAtoi(parts[1], &layer)) {
    auto it = BlockNames().find(parts[2]);
    if (it != BlockNames().end()) {
      return absl::StrCat("model.layers.", layer, ".", it->second, ".", parts[3]);
    }
  }
  return g;
}

absl::StatusOr<std::vector<TensorSplit>> PlanTpSplits(
    const Checkpoint& c, const SplitOptions& options) {
  const int32_t tp = options.tp;
  if (tp < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tp ", tp, " must be >= 1"));
  }
  const int32_t kv_heads =
      options.kv_heads > 0 ? options.kv_heads : KvHeadsOf(c);
  std::vector<TensorSplit> out;
  for (const CheckpointTensor& t : c.tensors) {
    TensorSplit s;
    s.file_name = t.name;
    s.name = HfNameOfGguf(t.name);
    s.type = t.file_type;
    s.file = t.file;
    s.data_file = c.files[t.file]->path();
    const int64_t block = BlockElems(t.dtype);
    const int64_t unit = UnitBytes(t.dtype);
    // Row-major [outer..., rows, cols]; a 1-D tensor is one row.
    const int64_t cols = t.shape.empty() ? 1 : t.shape.back();
    const int64_t rows = t.shape.size() >= 2 ? t.shape[t.shape.size() - 2] : 1;
    // A dim of 0 leaves the tensor's bytes at 0 however large the other
    // dims are (the reader accepts it): their products may not fit 64 bits.
    bool overflows = false;
    int64_t batches = 1;
    for (size_t d = 0; d + 2 < t.shape.size(); ++d) {
      overflows |= !CheckedMul(batches, t.shape[d], &batches);
    }
    int64_t row_bytes = 0;
    overflows |= !CheckedMul(cols / block, unit, &row_bytes);
    Role role = RoleOf(s.name);
    if (t.shape.size() == 1 && role == Role::kRow) role = Role::kReplicated;
    auto whole = [&] {
      s.ranks.clear();
      for (int32_t r = 0; r < tp; ++r) {
        RankRanges rr;
        rr.rank = r;
        Add(&rr, t.offset, t.offset + t.bytes);
        s.ranks.push_back(std::move(rr));
      }
    };
    auto fallback = [&](std::string why) {
      s.split = SplitKind::kFallback;
      s.reason = std::move(why);
      s.ranks.clear();
    };
    // 1-D column-parallel tensors (biases) split their only dim as rows.
    const int64_t split_rows = t.shape.size() == 1 ? cols : rows;
    const int64_t split_row_bytes = t.shape.size() == 1 ? unit / block : row_bytes;
    if (tp == 1 || role == Role::kReplicated || t.bytes == 0) {
      s.split = SplitKind::kReplicated;  // nothing to split in an empty one
      whole();
    } else if (overflows) {
      fallback("its row sizes overflow 64-bit byte counts");
    } else if (role == Role::kKv && kv_heads > 0 && tp > kv_heads) {
      // Each rank one whole kv head (vLLM: heads replicated over tp / kv
      // ranks), contiguous rows.
      if (split_rows % kv_heads != 0 || tp % kv_heads != 0) {
        fallback(absl::StrCat(split_rows, " rows of ", kv_heads,
                              " kv heads do not replicate over tp ", tp));
      } else {
        s.split = SplitKind::kReplicated;
        s.reason = absl::StrCat("tp ", tp, " > ", kv_heads,
                                " kv heads: each rank holds one whole head");
        const int64_t head_rows = split_rows / kv_heads;
        for (int32_t r = 0; r < tp; ++r) {
          RankRanges rr;
          rr.rank = r;
          const int64_t head = static_cast<int64_t>(r) * kv_heads / tp;
          for (int64_t b = 0; b < batches; ++b) {
            const int64_t base = t.offset + b * split_rows * split_row_bytes;
            Add(&rr, base + head * head_rows * split_row_bytes,
                base + (head + 1) * head_rows * split_row_bytes);
          }
          s.ranks.push_back(std::move(rr));
        }
      }
    } else if (role == Role::kColumn || role == Role::kKv) {
      if (t.shape.size() == 1 && block > 1) {
        fallback("a block-quantized 1-D tensor cannot split by rows");
      } else if (split_rows % tp != 0) {
        fallback(absl::StrCat(split_rows, " rows do not divide by tp ", tp));
      } else {
        s.split = SplitKind::kOuter;
        const int64_t per = split_rows / tp;
        for (int32_t r = 0; r < tp; ++r) {
          RankRanges rr;
          rr.rank = r;
          for (int64_t b = 0; b < batches; ++b) {
            const int64_t base = t.offset + b * split_rows * split_row_bytes;
            Add(&rr, base + r * per * split_row_bytes,
                base + (r + 1) * per * split_row_bytes);
          }
          s.ranks.push_back(std::move(rr));
        }
      }
    } else {  // kRow: the innermost dim, on whole blocks
      const int64_t per = cols / tp;
      if (cols % tp != 0) {
        fallback(absl::StrCat(cols, " columns do not divide by tp ", tp));
      } else if (per % block != 0) {
        fallback(absl::StrCat("a split at column ", per, " falls inside a ",
                              t.file_type, " block of ", block, " elements"));
      } else {
        s.split = SplitKind::kInner;
        const int64_t part_bytes = per / block * unit;
        for (int32_t r = 0; r < tp; ++r) {
          RankRanges rr;
          rr.rank = r;
          for (int64_t row = 0; row < batches * rows; ++row) {
            const int64_t at = t.offset + row * row_bytes + r * part_bytes;
            Add(&rr, at, at + part_bytes);
          }
          s.ranks.push_back(std::move(rr));
        }
      }
    }
    out.push_back(std::move(s));
  }
  return out;
}

std::string FormatTpSplits(const std::string& file, int32_t tp,
                           const std::vector<TensorSplit>& splits) {
  std::string out = absl::StrFormat("%s at tp %d: %d tensors\n", file, tp,
                                    static_cast<int>(splits.size()));
  for (const TensorSplit& s : splits) {
    absl::StrAppendFormat(&out, "%-34s %-46s %-6s %-10s", s.file_name, s.name,
                          s.type, SplitKindName(s.split));
    if (!s.reason.empty()) absl::StrAppend(&out, "  (", s.reason, ")");
    // A sharded checkpoint: the ranges below are in this shard.
    if (s.data_file != file) absl::StrAppend(&out, "  in ", s.data_file);
    absl::StrAppend(&out, "\n");
    for (const RankRanges& r : s.ranks) {
      int64_t bytes = 0;
      for (const auto& [a, b] : r.byte_ranges) bytes += b - a;
      absl::StrAppendFormat(&out, "    rank %d: %d bytes in %d ranges", r.rank,
                            bytes, static_cast<int>(r.byte_ranges.size()));
      const size_t shown = std::min<size_t>(r.byte_ranges.size(), 3);
      for (size_t i = 0; i < shown; ++i) {
        absl::StrAppendFormat(&out, " [%d, %d)", r.byte_ranges[i].first,
                              r.byte_ranges[i].second);
      }
      if (shown < r.byte_ranges.size()) absl::StrAppend(&out, " ...");
      absl::StrAppend(&out, "\n");
    }
  }
  return out;
}

std::string TpSplitsJson(const std::string& file, int32_t tp,
                         const std::vector<TensorSplit>& splits) {
  nlohmann::json j;
  j["file"] = file;
  j["tp"] = tp;
  j["tensors"] = nlohmann::json::array();
  for (const TensorSplit& s : splits) {
    nlohmann::json t;
    t["file_name"] = s.file_name;
    t["name"] = s.name;
    t["type"] = s.type;
    t["split"] = SplitKindName(s.split);
    t["reason"] = s.reason;
    t["data_file"] = s.data_file;
    t["ranks"] = nlohmann::json::array();
    for (const RankRanges& r : s.ranks) {
      nlohmann::json rr;
      rr["rank"] = r.rank;
      rr["byte_ranges"] = nlohmann::json::array();
      for (const auto& [a, b] : r.byte_ranges) {
        rr["byte_ranges"].push_back({a, b});
      }
      t["ranks"].push_back(std::move(rr));
    }
    j["tensors"].push_back(std::move(t));
  }
  return j.dump(2) + "\n";
}

}  // namespace ferry
