// checkpoint/tp_split.h: how a GGUF file's tensors split over TP 1, 2 and
// 4, checked against what each rank must hold, computed apart from the
// byte arithmetic: the Q8_0, Q4_K and Q6_K tensors are real quantizations
// of known matrices, so a rank's bytes must dequantize to its rows (outer)
// or columns (inner) of that matrix. The K-quant matrices are
// pseudo-random in [-1, 1], so a block from the wrong place misses by far
// more than the quantization error.
#include "checkpoint/tp_split.h"

#include <algorithm>
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

// A [rows, cols] matrix of pseudo-random values in [-1, 1].
std::vector<float> Noise(int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> m;
  uint32_t x = seed * 2654435761u + 1;
  for (int64_t i = 0; i < rows * cols; ++i) {
    x = x * 1664525u + 1013904223u;
    m.push_back(static_cast<float>(x >> 8) / static_cast<float>(1 << 23) - 1.0f);
  }
  return m;
}

// Values a rank holds vs. the matrix's share: rows [row0, row0 + rows) and
// columns [col0, col0 + cols) of a matrix `width` wide. The largest error.
float MaxError(const std::vector<float>& got, const std::vector<float>& m,
               int64_t width, int64_t row0, int64_t rows, int64_t col0,
               int64_t cols) {
  REQUIRE(got.size() == static_cast<size_t>(rows * cols));
  float worst = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      worst = std::max(worst, std::fabs(got[r * cols + c] -
                                        m[(row0 + r) * width + col0 + c]));
    }
  }
  return worst;
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
  std::vector<float> up;    // ffn_up  Q4_K [8, 256]  column-parallel
  std::vector<float> down;  // ffn_down Q6_K [2, 1024] row-parallel
};

// Quantization error bounds: half a step of the largest sub-block scale
// (Q4_K: range 2 over 15 steps; Q6_K: 1 over 31), plus the error of the
// 6- and 8-bit scales themselves.
constexpr float kQ4KError = 0.1f;
constexpr float kQ6KError = 0.03f;

Model Write() {
  Model m;
  m.q = Matrix(8, 64);
  m.o = Matrix(8, 128);
  m.k = Matrix(4, 64);
  m.up = Noise(8, 256, 1);
  m.down = Noise(2, 1024, 2);
  GgufWriter w;
  w.String("general.architecture", "llama");
  w.U32("llama.attention.head_count_kv", 2);
  w.Tensor("token_embd.weight", 0, {8, 16}, Bytes(16 * 8 * 4, 1));
  w.Tensor("blk.0.attn_norm.weight", 0, {64}, Bytes(64 * 4, 2));
  w.Tensor("blk.0.attn_q.weight", 8, {64, 8}, QuantizeQ8_0(m.q));
  w.Tensor("blk.0.attn_k.weight", 8, {64, 4}, QuantizeQ8_0(m.k));
  w.Tensor("blk.0.attn_output.weight", 8, {128, 8}, QuantizeQ8_0(m.o));
  w.Tensor("blk.0.ffn_up.weight", 12, {256, 8}, QuantizeQ4_K(m.up));
  w.Tensor("blk.0.ffn_down.weight", 14, {1024, 2}, QuantizeQ6_K(m.down));
  w.Tensor("output.weight", 1, {8, 16}, Bytes(16 * 8 * 2, 3));
  m.path = TempDir() + "/llama.gguf";
  WriteFile(m.path, w.Build());
  return m;
}

TEST_CASE("The test's K-quant writers round-trip known floats within the "
          "quantization error, in ggml's block sizes") {
  const std::vector<float> v = Noise(4, 512, 3);
  const Bytes q4 = QuantizeQ4_K(v);
  const Bytes q6 = QuantizeQ6_K(v);
  CHECK(q4.size() == 8 * 144);
  CHECK(q6.size() == 8 * 210);
  CHECK(MaxError(DequantizeQ4_K(q4.data(), v.size()), v, 512, 0, 4, 0, 512) < kQ4KError);
  CHECK(MaxError(DequantizeQ6_K(q6.data(), v.size()), v, 512, 0, 4, 0, 512) < kQ6KError);
  // A wrong block is far off: the error bound means something.
  CHECK(MaxError(DequantizeQ6_K(q6.data() + 210, 256), v, 512, 0, 1, 0, 256) > 0.5f);
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
    // ffn_up Q4_K [8, 256]: whole rows of one block each.
    const TensorSplit& up = Find(*s, "blk.0.ffn_up.weight");
    CHECK(up.split == (tp == 1 ? SplitKind::kReplicated : SplitKind::kOuter));
    for (int r = 0; r < tp; ++r) {
      const Bytes got = Gather(c, up.file, up.ranks[r]);
      const int rows = 8 / tp;
      REQUIRE(got.size() == static_cast<size_t>(rows * 144));
      CHECK(MaxError(DequantizeQ4_K(got.data(), rows * 256), m.up, 256,
                     r * rows, rows, 0, 256) < kQ4KError);
    }
    // ffn_down Q6_K [2, 1024] = 4 blocks per row: TP 2 and 4 split on
    // blocks; each rank's bytes dequantize to its columns.
    const TensorSplit& down = Find(*s, "blk.0.ffn_down.weight");
    CHECK(down.split == (tp == 1 ? SplitKind::kReplicated : SplitKind::kInner));
    for (int r = 0; r < tp; ++r) {
      const Bytes got = Gather(c, down.file, down.ranks[r]);
      const int cols = 1024 / tp;
      REQUIRE(got.size() == static_cast<size_t>(2 * (cols / 256) * 210));
      CHECK(MaxError(DequantizeQ6_K(got.data(), 2 * cols), m.down, 1024, 0, 2,
                     r * cols, cols) < kQ6KError);
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
