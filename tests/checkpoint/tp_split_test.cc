// checkpoint/tp_split.h: how a GGUF file's tensors split over TP 1, 2 and
// 4, checked against what each rank must hold, computed apart from the
// byte arithmetic: Q8_0 tensors are real quantizations of a known matrix,
// so a rank's bytes must dequantize to its rows (outer) or columns (inner)
// of that matrix; K-quant blocks carry their (row, block column) in their
// first bytes, so a rank's bytes must be exactly its blocks, in order.
#include "checkpoint/tp_split.h"

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "checkpoint/gguf.h"
#include "tests/checkpoint/checkpoint_writers.h"

namespace ferry {
namespace testing {
namespace {

// A [rows, cols] matrix whose every value says where it is.
std::vector<float> Matrix(int64_t rows, int64_t cols) {
  std::vector<float> m;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) m.push_back(0.01f * r + 0.0001f * c + 0.5f);
  }
  return m;
}

// K-quant blocks [rows, cols / 256] tagged with their position.
Bytes TaggedBlocks(int64_t rows, int64_t blocks_per_row, int64_t block_bytes) {
  Bytes b;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t k = 0; k < blocks_per_row; ++k) {
      Bytes blk(block_bytes, 0xee);
      std::memcpy(blk.data(), &r, 4);
      std::memcpy(blk.data() + 4, &k, 4);
      b.insert(b.end(), blk.begin(), blk.end());
    }
  }
  return b;
}

Bytes Gather(const Checkpoint& c, int32_t file, const RankRanges& r) {
  Bytes out;
  for (const auto& [a, b] : r.byte_ranges) {
    out.insert(out.end(), c.files[file]->data() + a, c.files[file]->data() + b);
  }
  return out;
}

const TensorSplit& Find(const std::vector<TensorSplit>& s, const std::string& n) {
  for (const TensorSplit& t : s) {
    if (t.file_name == n) return t;
  }
  FAIL("no split for " << n);
  return s[0];
}

struct Model {
  std::string path;
  std::vector<float> q;     // attn_q  Q8_0 [8, 64]   column-parallel
  std::vector<float> o;     // attn_output Q8_0 [8, 128] row-parallel
  std::vector<float> k;     // attn_k  Q8_0 [4, 64] (2 kv heads of 2 rows)
};

Model Write() {
  Model m;
  m.q = Matrix(8, 64);
  m.o = Matrix(8, 128);
  m.k = Matrix(4, 64);
  GgufWriter w;
  w.String("general.architecture", "llama");
  w.U32("llama.attention.head_count_kv", 2);
  w.Tensor("token_embd.weight", 0, {8, 16}, Bytes(16 * 8 * 4, 1));
  w.Tensor("blk.0.attn_norm.weight", 0, {64}, Bytes(64 * 4, 2));
  w.Tensor("blk.0.attn_q.weight", 8, {64, 8}, QuantizeQ8_0(m.q));
  w.Tensor("blk.0.attn_k.weight", 8, {64, 4}, QuantizeQ8_0(m.k));
  w.Tensor("blk.0.attn_output.weight", 8, {128, 8}, QuantizeQ8_0(m.o));
  w.Tensor("blk.0.ffn_up.weight", 12, {256, 8}, TaggedBlocks(8, 1, 144));
  w.Tensor("blk.0.ffn_down.weight", 14, {1024, 2}, TaggedBlocks(2, 4, 210));
  w.Tensor("output.weight", 1, {8, 16}, Bytes(16 * 8 * 2, 3));
  m.path = TempDir() + "/llama.gguf";
  WriteFile(m.path, w.Build());
  return m;
}

TEST_CASE("GGUF names map to the Hugging Face names engines declare") {
  CHECK(HfNameOfGguf("token_embd.weight") == "model.embed_tokens.weight");
  CHECK(HfNameOfGguf("output.weight") == "lm_head.weight");
  CHECK(HfNameOfGguf("output_norm.weight") == "model.norm.weight");
  CHECK(HfNameOfGguf("blk.12.attn_q.weight") ==
        "model.layers.12.self_attn.q_proj.weight");
  CHECK(HfNameOfGguf("blk.0.attn_output.weight") ==
        "model.layers.0.self_attn.o_proj.weight");
  CHECK(HfNameOfGguf("blk.3.ffn_norm.weight") ==
        "model.layers.3.post_attention_layernorm.weight");
  CHECK(HfNameOfGguf("blk.3.ffn_down_exps.weight") ==
        "model.layers.3.mlp.experts.down_proj.weight");
  CHECK(HfNameOfGguf("blk.3.ffn_gate_inp.weight") ==
        "model.layers.3.mlp.gate.weight");
  CHECK(HfNameOfGguf("model.norm.weight") == "model.norm.weight");
}

TEST_CASE("TP 1, 2, 4: every rank's bytes are the file's bytes of its share") {
  const Model m = Write();
  absl::StatusOr<GgufFile> g = ReadGguf(m.path);
  REQUIRE(g.ok());
  const Checkpoint& c = g->checkpoint;
  for (int tp : {1, 2, 4}) {
    INFO("tp " << tp);
    SplitOptions o;
    o.tp = tp;
    absl::StatusOr<std::vector<TensorSplit>> s = PlanTpSplits(c, o);
    REQUIRE(s.ok());
    // q: outer, rows [r * 8 / tp, ...) of the matrix.
    const TensorSplit& q = Find(*s, "blk.0.attn_q.weight");
    CHECK(q.name == "model.layers.0.self_attn.q_proj.weight");
    CHECK(q.split == (tp == 1 ? SplitKind::kReplicated : SplitKind::kOuter));
    for (int r = 0; r < tp; ++r) {
      const Bytes got = Gather(c, q.file, q.ranks[r]);
      const std::vector<float> vals = DequantizeQ8_0(got.data(), got.size() / 34 * 32);
      const int rows = 8 / tp;
      REQUIRE(vals.size() == static_cast<size_t>(rows * 64));
      for (int i = 0; i < rows; ++i) {
        for (int col = 0; col < 64; ++col) {
          CHECK(std::fabs(vals[i * 64 + col] - m.q[(r * rows + i) * 64 + col]) < 0.01f);
        }
      }
      CHECK(q.ranks[r].byte_ranges.size() == 1);  // whole rows: contiguous
    }
    // o: inner, columns [r * 128 / tp, ...) of every row; TP 4 is one
    // block per row and rank.
    const TensorSplit& out = Find(*s, "blk.0.attn_output.weight");
    CHECK(out.split == (tp == 1 ? SplitKind::kReplicated : SplitKind::kInner));
    for (int r = 0; r < tp; ++r) {
      const Bytes got = Gather(c, out.file, out.ranks[r]);
      const int cols = 128 / tp;
      const std::vector<float> vals = DequantizeQ8_0(got.data(), 8 * cols);
      for (int row = 0; row < 8; ++row) {
        for (int col = 0; col < cols; ++col) {
          CHECK(std::fabs(vals[row * cols + col] -
                          m.o[row * 128 + r * cols + col]) < 0.01f);
        }
      }
      if (tp > 1) CHECK(out.ranks[r].byte_ranges.size() == 8);  // one per row
    }
    // ffn_down Q6_K [2, 1024] = 4 blocks per row: TP 2 and 4 split on
    // blocks; each rank exactly its blocks, in order.
    const TensorSplit& down = Find(*s, "blk.0.ffn_down.weight");
    CHECK(down.split == (tp == 1 ? SplitKind::kReplicated : SplitKind::kInner));
    for (int r = 0; r < tp; ++r) {
      const Bytes got = Gather(c, down.file, down.ranks[r]);
      const int per = 4 / tp;
      REQUIRE(got.size() == static_cast<size_t>(2 * per * 210));
      for (int row = 0, i = 0; row < 2; ++row) {
        for (int k = r * per; k < (r + 1) * per; ++k, ++i) {
          int32_t tag_row, tag_k;
          std::memcpy(&tag_row, got.data() + i * 210, 4);
          std::memcpy(&tag_k, got.data() + i * 210 + 4, 4);
          CHECK(tag_row == row);
          CHECK(tag_k == k);
        }
      }
    }
    // k: 2 kv heads; at TP 4 each rank one whole head (2 rows).
    const TensorSplit& k = Find(*s, "blk.0.attn_k.weight");
    if (tp == 4) {
      CHECK(k.split == SplitKind::kReplicated);
      CHECK(k.reason == "tp 4 > 2 kv heads: each rank holds one whole head");
      for (int r = 0; r < 4; ++r) {
        const Bytes got = Gather(c, k.file, k.ranks[r]);
        const std::vector<float> vals = DequantizeQ8_0(got.data(), 2 * 64);
        const int head = r / 2;
        for (int i = 0; i < 2 * 64; ++i) {
          CHECK(std::fabs(vals[i] - m.k[head * 2 * 64 + i]) < 0.01f);
        }
      }
    } else {
      CHECK(k.split == (tp == 1 ? SplitKind::kReplicated : SplitKind::kOuter));
    }
    // The norm: every rank the whole tensor.
    const TensorSplit& norm = Find(*s, "blk.0.attn_norm.weight");
    CHECK(norm.split == SplitKind::kReplicated);
    const CheckpointTensor& nt = c.tensors[c.Find("blk.0.attn_norm.weight")];
    for (const RankRanges& r : norm.ranks) {
      REQUIRE(r.byte_ranges.size() == 1);
      CHECK(r.byte_ranges[0] == std::make_pair(nt.offset, nt.offset + nt.bytes));
    }
  }
}

TEST_CASE("A split inside a quantization block falls back, with the reason") {
  const Model m = Write();
  absl::StatusOr<GgufFile> g = ReadGguf(m.path);
  REQUIRE(g.ok());
  SplitOptions o;
  o.tp = 8;
  absl::StatusOr<std::vector<TensorSplit>> s = PlanTpSplits(g->checkpoint, o);
  REQUIRE(s.ok());
  // attn_output Q8_0 at TP 8: 16 columns per rank, inside a 32-element block.
  const TensorSplit& out = Find(*s, "blk.0.attn_output.weight");
  CHECK(out.split == SplitKind::kFallback);
  CHECK(out.reason == "a split at column 16 falls inside a Q8_0 block of 32 "
                      "elements");
  CHECK(out.ranks.empty());
  // ffn_down Q6_K at TP 8: 128 columns per rank inside a 256-element block.
  CHECK(Find(*s, "blk.0.ffn_down.weight").split == SplitKind::kFallback);
  // q at TP 8: one row each, outer.
  CHECK(Find(*s, "blk.0.attn_q.weight").split == SplitKind::kOuter);
  // The explain output names both, with their reasons.
  const std::string text = FormatTpSplits(m.path, 8, *s);
  CHECK(text.find("model.layers.0.self_attn.o_proj.weight") != std::string::npos);
  CHECK(text.find("fallback    (a split at column 16 falls inside a Q8_0 block") !=
        std::string::npos);
  const std::string json = TpSplitsJson(m.path, 8, *s);
  CHECK(json.find("\"split\": \"fallback\"") != std::string::npos);
  CHECK(json.find("\"byte_ranges\"") != std::string::npos);
  o.tp = 0;
  CHECK_FALSE(PlanTpSplits(g->checkpoint, o).ok());
}

}  // namespace
}  // namespace testing
}  // namespace ferry
