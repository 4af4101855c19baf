// Layout resolution against an independent model of vLLM's loaders.
//
// Every checkpoint parameter gets a synthetic global tensor. The oracle
// builds each rank's live tensor the way vLLM's weight loaders would
// (narrow along the shard dim, concatenate fused parts, stack experts, pad
// the vocabulary) using plain tensor operations that know nothing of boxes
// or pieces. The test then executes the resolved pieces, copying from the
// global tensors into fresh rank buffers, and compares the bytes: every live
// byte written exactly once with the oracle's value, padding never written,
// and every fallback tensor staged whole.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <sstream>
#include <utility>
#include <vector>

#include "core/layout_resolution.h"
#include "core/parallel_for.h"
#include "core/validation.h"

namespace ferry {
namespace {

// A byte no synthetic tensor contains: the value of bytes nothing wrote.
constexpr uint8_t kUnwritten = 0xEE;

// ---------------------------------------------------------------------------
// A tiny tensor of storage units (elements, or blocks for GGUF dtypes).

struct Tensor {
  Dims shape;  // storage units; the last dim counts blocks for GGUF dtypes
  int64_t unit_bytes = 1;
  std::vector<uint8_t> bytes;
};

int64_t Product(const Dims& d, size_t begin, size_t end) {
  int64_t n = 1;
  for (size_t i = begin; i < end; ++i) n *= d[i];
  return n;
}

Tensor Filled(const Dims& shape, int64_t unit_bytes, uint8_t value) {
  Tensor t{shape, unit_bytes, {}};
  t.bytes.assign(Product(shape, 0, shape.size()) * unit_bytes, value);
  return t;
}

// Deterministic pseudo-random bytes in [0, 0xE0), never kUnwritten.
Tensor Synthetic(const Dims& shape, int64_t unit_bytes, uint32_t seed) {
  Tensor t = Filled(shape, unit_bytes, 0);
  uint32_t x = seed * 2654435761u + 1;
  for (uint8_t& b : t.bytes) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    b = static_cast<uint8_t>(x % 0xE0);
  }
  return t;
}

// torch.narrow.
Tensor Narrow(const Tensor& t, size_t dim, int64_t start, int64_t len) {
  REQUIRE(start >= 0);
  REQUIRE(start + len <= t.shape[dim]);
  Tensor out{t.shape, t.unit_bytes, {}};
  out.shape[dim] = len;
  const int64_t outer = Product(t.shape, 0, dim);
  const int64_t row = Product(t.shape, dim + 1, t.shape.size()) * t.unit_bytes;
  for (int64_t o = 0; o < outer; ++o) {
    auto first = t.bytes.begin() + (o * t.shape[dim] + start) * row;
    out.bytes.insert(out.bytes.end(), first, first + len * row);
  }
  return out;
}

// torch.cat.
Tensor Cat(const std::vector<Tensor>& ts, size_t dim) {
  Tensor out{ts[0].shape, ts[0].unit_bytes, {}};
  out.shape[dim] = 0;
  for (const Tensor& t : ts) out.shape[dim] += t.shape[dim];
  const int64_t outer = Product(out.shape, 0, dim);
  for (int64_t o = 0; o < outer; ++o) {
    for (const Tensor& t : ts) {
      const int64_t n =
          Product(t.shape, dim, t.shape.size()) * t.unit_bytes;
      auto first = t.bytes.begin() + o * n;
      out.bytes.insert(out.bytes.end(), first, first + n);
    }
  }
  return out;
}

// torch.stack along a new dim 0.
Tensor Stack(const std::vector<Tensor>& ts) {
  Tensor out{ts[0].shape, ts[0].unit_bytes, {}};
  out.shape.insert(out.shape.begin(), static_cast<int64_t>(ts.size()));
  for (const Tensor& t : ts) {
    out.bytes.insert(out.bytes.end(), t.bytes.begin(), t.bytes.end());
  }
  return out;
}

// ---------------------------------------------------------------------------
// vLLM's loaders, restated as tensor operations.

// ColumnParallelLinear / RowParallelLinear.weight_loader.
Tensor VllmShard(const Tensor& g, size_t dim, int tp, int rank) {
  const int64_t len = g.shape[dim] / tp;
  return Narrow(g, dim, rank * len, len);
}

// VocabParallelEmbedding: vocab padded to a multiple of 64, split evenly;
// the loader copies the real rows and the padding stays as it was.
Tensor VllmVocab(const Tensor& g, int tp, int rank) {
  const int64_t vocab = g.shape[0];
  const int64_t per = (vocab + 63) / 64 * 64 / tp;
  const int64_t start = std::min(rank * per, vocab);
  const int64_t end = std::min((rank + 1) * per, vocab);
  Dims pad_shape = g.shape;
  pad_shape[0] = per - (end - start);
  return Cat({Narrow(g, 0, start, end - start),
              Filled(pad_shape, g.unit_bytes, kUnwritten)},
             0);
}

// QKVParallelLinear: q heads split over ranks; kv heads split too, or, when
// tp >= kv heads, one kv head per rank, shared by tp / kv_heads ranks.
Tensor VllmQkv(const Tensor& q, const Tensor& k, const Tensor& v,
               int64_t heads, int64_t kv_heads, int64_t head_dim, int tp,
               int rank) {
  const int64_t q_rows = heads / tp * head_dim;
  const int64_t kv_per = tp >= kv_heads ? 1 : kv_heads / tp;
  const int64_t replicas = tp >= kv_heads ? tp / kv_heads : 1;
  const int64_t kv_rows = kv_per * head_dim;
  const int64_t kv_shard = rank / replicas;
  return Cat({Narrow(q, 0, rank * q_rows, q_rows),
              Narrow(k, 0, kv_shard * kv_rows, kv_rows),
              Narrow(v, 0, kv_shard * kv_rows, kv_rows)},
             0);
}

// ---------------------------------------------------------------------------
// Fixtures: a model with synthetic weights, and engine tables.

class Fixture {
 public:
  int32_t Add(const std::string& name, Dims shape,
              DType dtype = DType::kBF16) {
    const int32_t id = static_cast<int32_t>(model_.params.size());
    model_.params.push_back({name, dtype, shape});
    globals_.push_back(Synthetic(StorageShape(shape, dtype), UnitBytes(dtype),
                                 static_cast<uint32_t>(id + 1)));
    model_.BuildIndex();
    return id;
  }
  const ModelSpec& model() const { return model_; }
  const std::vector<Tensor>& globals() const { return globals_; }
  int32_t Id(const std::string& name) const {
    const int32_t id = model_.Find(name);
    INFO(name);
    REQUIRE(id >= 0);
    return id;
  }
  const Tensor& G(const std::string& name) const { return globals_[Id(name)]; }

 private:
  ModelSpec model_;
  std::vector<Tensor> globals_;
};

struct Instance {
  std::vector<EngineTable> tables;  // by rank
  // By rank: engine name -> the live tensor vLLM's loader would produce.
  std::vector<std::map<std::string, Tensor>> expected;
};

// Lays one rank's parameters out one after another in buffer 0.
class TableBuilder {
 public:
  TableBuilder(int32_t rank, int32_t tp) {
    table_.tp_rank = rank;
    table_.tp_size = tp;
    table_.node = "node-b";
  }
  // The reference is valid until the next Add.
  EngineParam& Add(const std::string& name, LoaderKind loader, Dims local,
                   Tensor expected = {}, DType dtype = DType::kBF16) {
    EngineParam p;
    p.name = name;
    p.dtype = dtype;
    p.local_shape = local;
    p.loader = loader;
    p.tp_size = table_.tp_size;
    p.buffer = 0;
    p.byte_offset = next_;
    Dims units = local;
    units.back() = (units.back() + BlockElems(dtype) - 1) / BlockElems(dtype);
    next_ += (Volume(units) * UnitBytes(dtype) + 63) / 64 * 64 + 64;
    if (!expected.bytes.empty()) expected_[name] = std::move(expected);
    table_.params.push_back(std::move(p));
    return table_.params.back();
  }
  void Finish(Instance* inst) {
    table_.buffer_bytes = {next_};
    inst->tables.push_back(table_);
    inst->expected.push_back(expected_);
  }

 private:
  EngineTable table_;
  std::map<std::string, Tensor> expected_;
  int64_t next_ = 0;
};

// A Llama-ish layer 0 with GQA and Qwen-style qkv biases, a MoE layer 1
// with 4 experts, embeddings and an untied lm_head.
struct Dimensions {
  int64_t hidden = 64;
  int64_t heads = 8;
  int64_t kv_heads = 2;
  int64_t head_dim = 8;
  int64_t inter = 128;
  int64_t vocab = 1000;
  int64_t experts = 4;
  int64_t moe_inter = 32;
};

const std::string L0 = "model.layers.0.";
const std::string L1 = "model.layers.1.";

std::string Expert(int64_t e, const std::string& proj) {
  return L1 + "mlp.experts." + std::to_string(e) + "." + proj + ".weight";
}

Fixture LlamaFixture(const Dimensions& d = {}) {
  Fixture f;
  const int64_t H = d.hidden, q = d.heads * d.head_dim,
                kv = d.kv_heads * d.head_dim;
  f.Add("model.embed_tokens.weight", {d.vocab, H});
  f.Add(L0 + "input_layernorm.weight", {H});
  f.Add(L0 + "self_attn.q_proj.weight", {q, H});
  f.Add(L0 + "self_attn.k_proj.weight", {kv, H});
  f.Add(L0 + "self_attn.v_proj.weight", {kv, H});
  f.Add(L0 + "self_attn.q_proj.bias", {q});
  f.Add(L0 + "self_attn.k_proj.bias", {kv});
  f.Add(L0 + "self_attn.v_proj.bias", {kv});
  f.Add(L0 + "self_attn.o_proj.weight", {H, q});
  f.Add(L0 + "post_attention_layernorm.weight", {H});
  f.Add(L0 + "mlp.gate_proj.weight", {d.inter, H});
  f.Add(L0 + "mlp.up_proj.weight", {d.inter, H});
  f.Add(L0 + "mlp.down_proj.weight", {H, d.inter});
  f.Add(L1 + "mlp.gate.weight", {d.experts, H});
  for (int64_t e = 0; e < d.experts; ++e) {
    f.Add(Expert(e, "gate_proj"), {d.moe_inter, H});
    f.Add(Expert(e, "up_proj"), {d.moe_inter, H});
    f.Add(Expert(e, "down_proj"), {H, d.moe_inter});
  }
  f.Add("model.norm.weight", {H});
  f.Add("lm_head.weight", {d.vocab, H});
  return f;
}

// vLLM's parameter table for every rank of a `tp`-way instance, with
// `declare_kv` saying whether qkv declares its kv parts' local rows.
Instance LlamaInstance(const Fixture& f, int tp, const Dimensions& d = {},
                       bool declare_kv = true) {
  Instance inst;
  const int64_t H = d.hidden;
  const int64_t q_rows = d.heads / tp * d.head_dim;
  const int64_t kv_rows =
      (tp >= d.kv_heads ? 1 : d.kv_heads / tp) * d.head_dim;
  const int64_t vocab_rows = (d.vocab + 63) / 64 * 64 / tp;
  const std::string attn = L0 + "self_attn.";
  for (int r = 0; r < tp; ++r) {
    auto shard = [&](const std::string& name, size_t dim) {
      return VllmShard(f.G(name), dim, tp, r);
    };
    TableBuilder b(r, tp);
    b.Add("model.embed_tokens.weight", LoaderKind::kVocabParallel,
          {vocab_rows, H}, VllmVocab(f.G("model.embed_tokens.weight"), tp, r));
    b.Add(L0 + "input_layernorm.weight", LoaderKind::kReplicated, {H},
          f.G(L0 + "input_layernorm.weight"));
    for (const std::string kind : {"weight", "bias"}) {
      const bool w = kind == "weight";
      Dims local = {q_rows + 2 * kv_rows};
      if (w) local.push_back(H);
      EngineParam& p = b.Add(
          attn + "qkv_proj." + kind, LoaderKind::kFused, local,
          VllmQkv(f.G(attn + "q_proj." + kind), f.G(attn + "k_proj." + kind),
                  f.G(attn + "v_proj." + kind), d.heads, d.kv_heads,
                  d.head_dim, tp, r));
      const int64_t declared = declare_kv ? kv_rows : 0;
      p.parts = {{attn + "q_proj." + kind, {}},
                 {attn + "k_proj." + kind, {}, declared},
                 {attn + "v_proj." + kind, {}, declared}};
    }
    b.Add(attn + "o_proj.weight", LoaderKind::kRow, {H, q_rows},
          shard(attn + "o_proj.weight", 1))
        .shard_dim = 1;
    b.Add(L0 + "post_attention_layernorm.weight", LoaderKind::kReplicated,
          {H}, f.G(L0 + "post_attention_layernorm.weight"));
    b.Add(L0 + "mlp.gate_up_proj.weight", LoaderKind::kFused,
          {2 * d.inter / tp, H},
          Cat({shard(L0 + "mlp.gate_proj.weight", 0),
               shard(L0 + "mlp.up_proj.weight", 0)},
              0))
        .parts = {{L0 + "mlp.gate_proj.weight", {}},
                  {L0 + "mlp.up_proj.weight", {}}};
    b.Add(L0 + "mlp.down_proj.weight", LoaderKind::kRow, {H, d.inter / tp},
          shard(L0 + "mlp.down_proj.weight", 1))
        .shard_dim = 1;
    b.Add(L1 + "mlp.gate.weight", LoaderKind::kReplicated, {d.experts, H},
          f.G(L1 + "mlp.gate.weight"));
    // FusedMoE: w13 = [experts, gate rows ++ up rows, hidden],
    // w2 = [experts, hidden, down cols], each expert sharded like a linear.
    std::vector<Tensor> w13, w2;
    std::vector<FusedPart> w13_parts, w2_parts;
    for (int64_t e = 0; e < d.experts; ++e) {
      w13.push_back(Cat({shard(Expert(e, "gate_proj"), 0),
                         shard(Expert(e, "up_proj"), 0)},
                        0));
      w2.push_back(shard(Expert(e, "down_proj"), 1));
      w13_parts.push_back({Expert(e, "gate_proj"), {e}});
      w13_parts.push_back({Expert(e, "up_proj"), {e}});
      w2_parts.push_back({Expert(e, "down_proj"), {e}});
    }
    b.Add(L1 + "mlp.experts.w13_weight", LoaderKind::kFused,
          {d.experts, 2 * d.moe_inter / tp, H}, Stack(w13))
        .parts = w13_parts;
    EngineParam& p = b.Add(L1 + "mlp.experts.w2_weight", LoaderKind::kFused,
                           {d.experts, H, d.moe_inter / tp}, Stack(w2));
    p.parts = w2_parts;
    p.shard_dim = 1;
    b.Add("model.norm.weight", LoaderKind::kReplicated, {H},
          f.G("model.norm.weight"));
    b.Add("lm_head.weight", LoaderKind::kVocabParallel, {vocab_rows, H},
          VllmVocab(f.G("lm_head.weight"), tp, r));
    b.Finish(&inst);
  }
  return inst;
}

// ---------------------------------------------------------------------------
// Executing pieces and comparing with the oracle.

struct Memory {
  std::map<uint32_t, std::vector<uint8_t>> bytes;
  std::map<uint32_t, std::vector<uint8_t>> writes;  // per byte
};

// Copies the piece's box of the global tensor into its buffer.
void ApplyPiece(const Fixture& f, const Piece& piece, Memory* mem) {
  const ParamSpec& c = f.model().params[piece.param];
  INFO("piece of " << c.name << " box " << BoxToString(piece.box)
                   << " buffer " << piece.buffer);
  REQUIRE(ValidateBoxInShape(piece.box, c.shape).ok());
  const Tensor& g = f.globals()[piece.param];
  const Box units = StorageBox(piece.box, c.dtype);
  REQUIRE(piece.strides.size() == units.rank());
  REQUIRE(mem->bytes.count(piece.buffer) == 1);
  std::vector<uint8_t>& buf = mem->bytes[piece.buffer];
  std::vector<uint8_t>& writes = mem->writes[piece.buffer];
  const Dims gstrides = RowMajorStrides(g.shape);
  const int64_t ub = g.unit_bytes;
  if (Volume(units.extent) == 0) return;
  Dims idx(units.rank(), 0);
  bool in_bounds = true;
  for (bool more = true; more;) {
    int64_t src = 0, dst = 0;
    for (size_t j = 0; j < idx.size(); ++j) {
      src += (units.offset[j] + idx[j]) * gstrides[j];
      dst += idx[j] * piece.strides[j];
    }
    const int64_t at = piece.byte_offset + dst * ub;
    if (at < 0 || at + ub > static_cast<int64_t>(buf.size())) {
      in_bounds = false;
      break;
    }
    std::memcpy(&buf[at], &g.bytes[src * ub], ub);
    for (int64_t b = 0; b < ub; ++b) ++writes[at + b];
    more = false;
    for (size_t j = idx.size(); j-- > 0;) {
      if (++idx[j] < units.extent[j]) {
        more = true;
        break;
      }
      idx[j] = 0;
    }
  }
  CHECK(in_bounds);
}

const ParamDecision& DecisionOf(const ResolvedRank& rank,
                                const std::string& name) {
  for (const ParamDecision& d : rank.decisions) {
    if (d.engine_name == name) return d;
  }
  FAIL("no decision for " << name);
  return rank.decisions.front();
}

std::vector<Piece> PiecesOf(const ResolvedRank& rank, int32_t param) {
  std::vector<Piece> out;
  for (const Piece& p : rank.layout.pieces) {
    if (p.param == param) out.push_back(p);
  }
  return out;
}

// Resolves `inst`, executes every rank's pieces and checks them against the
// oracle: direct and fused parameters hold vLLM's bytes, written once each,
// padding untouched, nothing else of the live buffers written, and every
// fallback tensor staged whole at byte 0 of its own staging buffer.
ResolvedInstance ResolveAndCheck(const Fixture& f, const Instance& inst) {
  absl::StatusOr<ResolvedInstance> resolved =
      ResolveDestinationLayout(f.model(), inst.tables);
  INFO(resolved.status().ToString());
  REQUIRE(resolved.ok());
  REQUIRE(resolved->ranks.size() == inst.tables.size());
  for (size_t r = 0; r < inst.tables.size(); ++r) {
    INFO("rank " << r);
    const EngineTable& table = inst.tables[r];
    const ResolvedRank& rank = resolved->ranks[r];
    REQUIRE(rank.layout.rank == static_cast<int32_t>(r));
    REQUIRE(rank.decisions.size() == table.params.size());
    Memory mem;
    for (size_t b = 0; b < table.buffer_bytes.size(); ++b) {
      mem.bytes[b].assign(table.buffer_bytes[b], kUnwritten);
      mem.writes[b].assign(table.buffer_bytes[b], 0);
    }
    for (size_t k = 0; k < rank.fallback.size(); ++k) {
      const FallbackTensor& ft = rank.fallback[k];
      CHECK(ft.staging_buffer == (kStagingBufferBit | k));
      const size_t n = f.globals()[ft.param].bytes.size();
      mem.bytes[ft.staging_buffer].assign(n, kUnwritten);
      mem.writes[ft.staging_buffer].assign(n, 0);
    }
    for (const Piece& piece : rank.layout.pieces) ApplyPiece(f, piece, &mem);

    int64_t expected_writes = 0;
    for (size_t i = 0; i < table.params.size(); ++i) {
      const EngineParam& p = table.params[i];
      const ParamDecision& d = rank.decisions[i];
      INFO(p.name << ": " << d.reason);
      CHECK(d.engine_name == p.name);
      // An alias shares its target's bytes, checked with the target.
      if (!p.alias_of.empty()) continue;
      if (d.resolution == Resolution::kFallback) {
        for (int32_t id : d.checkpoint_params) {
          bool staged = false;
          for (const FallbackTensor& ft : rank.fallback) staged |= ft.param == id;
          CHECK(staged);
        }
        continue;
      }
      auto it = inst.expected[r].find(p.name);
      REQUIRE(it != inst.expected[r].end());
      const std::vector<uint8_t>& want = it->second.bytes;
      const std::vector<uint8_t>& got = mem.bytes[p.buffer];
      const std::vector<uint8_t>& writes = mem.writes[p.buffer];
      int64_t wrong = 0, first_wrong = -1;
      for (size_t b = 0; b < want.size(); ++b) {
        const size_t at = p.byte_offset + b;
        const bool pad = want[b] == kUnwritten;
        if (got[at] != want[b] || writes[at] != (pad ? 0 : 1)) {
          if (wrong++ == 0) first_wrong = static_cast<int64_t>(b);
        }
        if (!pad) ++expected_writes;
      }
      INFO("first wrong byte " << first_wrong << " of " << want.size());
      CHECK(wrong == 0);
    }
    // Nothing outside the direct parameters was written.
    int64_t live_writes = 0;
    for (size_t b = 0; b < table.buffer_bytes.size(); ++b) {
      for (uint8_t w : mem.writes[b]) live_writes += w;
    }
    CHECK(live_writes == expected_writes);
    for (const FallbackTensor& ft : rank.fallback) {
      INFO("staged " << f.model().params[ft.param].name);
      CHECK(mem.bytes[ft.staging_buffer] == f.globals()[ft.param].bytes);
      CHECK(std::all_of(mem.writes[ft.staging_buffer].begin(),
                        mem.writes[ft.staging_buffer].end(),
                        [](uint8_t w) { return w == 1; }));
    }
  }
  return *std::move(resolved);
}

// ---------------------------------------------------------------------------
// Direct and fused resolution.

TEST_CASE("Llama and MoE layers resolve to vLLM's shards at tp 1, 2, 4, 8") {
  const Fixture f = LlamaFixture();
  for (int tp : {1, 2, 4, 8}) {
    INFO("tp " << tp);
    const Instance inst = LlamaInstance(f, tp);
    const ResolvedInstance res = ResolveAndCheck(f, inst);
    for (const ResolvedRank& rank : res.ranks) {
      CHECK(rank.fallback.empty());
      for (const ParamDecision& d : rank.decisions) {
        INFO(d.engine_name << ": " << d.reason);
        const bool fused = d.engine_name.find("qkv_proj") != std::string::npos ||
                           d.engine_name.find("gate_up") != std::string::npos ||
                           d.engine_name.find("experts.w") != std::string::npos;
        CHECK(d.resolution ==
              (fused ? Resolution::kFused : Resolution::kDirect));
      }
    }
  }
}

TEST_CASE("Tables in any order resolve by TP rank") {
  const Fixture f = LlamaFixture();
  Instance inst = LlamaInstance(f, 4);
  std::swap(inst.tables[0], inst.tables[3]);
  std::swap(inst.tables[1], inst.tables[2]);
  auto res = ResolveDestinationLayout(f.model(), inst.tables);
  REQUIRE(res.ok());
  for (int r = 0; r < 4; ++r) CHECK(res->ranks[r].layout.rank == r);
}

TEST_CASE("Boxes and reasons at tp 4, GQA kv heads replicated") {
  const Fixture f = LlamaFixture();
  const Instance inst = LlamaInstance(f, 4);
  const ResolvedInstance res = ResolveAndCheck(f, inst);
  const ResolvedRank& r2 = res.ranks[2];
  const EngineTable& t2 = inst.tables[2];
  auto param = [&](const std::string& name) -> const EngineParam& {
    for (const EngineParam& p : t2.params) {
      if (p.name == name) return p;
    }
    FAIL("no param " << name);
    return t2.params.front();
  };

  // qkv: q rows 16 per rank; 2 kv heads of 8 rows over 4 ranks: ranks 2
  // and 3 share kv head 1 (rows 8:16).
  const std::string attn = L0 + "self_attn.";
  const ParamDecision& qkv = DecisionOf(r2, attn + "qkv_proj.weight");
  CHECK(qkv.resolution == Resolution::kFused);
  CHECK(qkv.reason ==
        "fused along dim 0 (3 parts): q_proj.weight rows 32:48, "
        "k_proj.weight rows 8:16 (x2 replicas), v_proj.weight rows 8:16 "
        "(x2 replicas)");
  CHECK(qkv.checkpoint_params ==
        std::vector<int32_t>{f.Id(attn + "q_proj.weight"),
                             f.Id(attn + "k_proj.weight"),
                             f.Id(attn + "v_proj.weight")});
  const int64_t qkv_at = param(attn + "qkv_proj.weight").byte_offset;
  auto q = PiecesOf(r2, f.Id(attn + "q_proj.weight"));
  REQUIRE(q.size() == 1);
  CHECK(q[0].box == Box{{32, 0}, {16, 64}});
  CHECK(q[0].byte_offset == qkv_at);
  CHECK(q[0].strides == Dims{64, 1});
  CHECK(q[0].buffer == 0);
  auto v = PiecesOf(r2, f.Id(attn + "v_proj.weight"));
  REQUIRE(v.size() == 1);
  CHECK(v[0].box == Box{{8, 0}, {8, 64}});
  CHECK(v[0].byte_offset == qkv_at + (16 + 8) * 64 * 2);
  auto vb = PiecesOf(r2, f.Id(attn + "v_proj.bias"));
  REQUIRE(vb.size() == 1);
  CHECK(vb[0].box == Box{{8}, {8}});
  CHECK(vb[0].strides == Dims{1});

  const ParamDecision& o = DecisionOf(r2, attn + "o_proj.weight");
  CHECK(o.resolution == Resolution::kDirect);
  CHECK(o.reason == "row shard of dim 1 (columns 32:48)");
  auto op = PiecesOf(r2, f.Id(attn + "o_proj.weight"));
  REQUIRE(op.size() == 1);
  CHECK(op[0].box == Box{{0, 32}, {64, 16}});
  CHECK(op[0].strides == Dims{16, 1});
  CHECK(op[0].byte_offset == param(attn + "o_proj.weight").byte_offset);

  CHECK(DecisionOf(r2, "model.norm.weight").reason == "replicated (whole [64])");
  CHECK(DecisionOf(r2, "model.embed_tokens.weight").reason ==
        "vocab shard of dim 0 (rows 512:768)");
  CHECK(DecisionOf(res.ranks[3], "lm_head.weight").reason ==
        "vocab shard of dim 0 (rows 768:1000, 24 padding rows)");
  CHECK(PiecesOf(res.ranks[3], f.Id("lm_head.weight"))[0].box ==
        Box{{768, 0}, {232, 64}});
}

TEST_CASE("MoE w13 and w2 pieces sit at their expert's lead index") {
  const Fixture f = LlamaFixture();
  const Instance inst = LlamaInstance(f, 2);
  const ResolvedInstance res = ResolveAndCheck(f, inst);
  const ResolvedRank& r1 = res.ranks[1];
  int64_t w13_at = -1, w2_at = -1;
  for (const EngineParam& p : inst.tables[1].params) {
    if (p.name == L1 + "mlp.experts.w13_weight") w13_at = p.byte_offset;
    if (p.name == L1 + "mlp.experts.w2_weight") w2_at = p.byte_offset;
  }
  // w13 local [4, 32, 64]: expert 2's up rows 16:32 at local [2, 16, 0].
  auto up2 = PiecesOf(r1, f.Id(Expert(2, "up_proj")));
  REQUIRE(up2.size() == 1);
  CHECK(up2[0].box == Box{{16, 0}, {16, 64}});
  CHECK(up2[0].strides == Dims{64, 1});
  CHECK(up2[0].byte_offset == w13_at + (2 * 32 * 64 + 16 * 64) * 2);
  // w2 local [4, 64, 16]: expert 3's down columns 16:32 at local [3, 0, 0].
  auto down3 = PiecesOf(r1, f.Id(Expert(3, "down_proj")));
  REQUIRE(down3.size() == 1);
  CHECK(down3[0].box == Box{{0, 16}, {64, 16}});
  CHECK(down3[0].strides == Dims{16, 1});
  CHECK(down3[0].byte_offset == w2_at + 3 * 64 * 16 * 2);
  CHECK(DecisionOf(r1, L1 + "mlp.experts.w2_weight").reason ==
        "fused along dim 1 (4 parts in 4 lead slots): 0.down_proj.weight "
        "columns 16:32, 1.down_proj.weight columns 16:32, 2.down_proj.weight "
        "columns 16:32, ...");
}

TEST_CASE("A plain column shard, and a shape that does not split") {
  Fixture f;
  f.Add("model.layers.0.self_attn.q_proj.weight", {4096, 64});
  Instance inst;
  for (int r = 0; r < 4; ++r) {
    TableBuilder b(r, 4);
    b.Add("model.layers.0.self_attn.q_proj.weight", LoaderKind::kColumn,
          {1024, 64}, VllmShard(f.G("model.layers.0.self_attn.q_proj.weight"),
                                0, 4, r));
    b.Finish(&inst);
  }
  auto res = ResolveAndCheck(f, inst);
  CHECK(res.ranks[1].decisions[0].reason ==
        "column shard of dim 0 (rows 1024:2048)");

  for (EngineTable& t : inst.tables) t.params[0].local_shape = {1000, 64};
  res = ResolveAndCheck(f, inst);
  CHECK(res.ranks[0].decisions[0].resolution == Resolution::kFallback);
  CHECK(res.ranks[0].decisions[0].reason ==
        "fallback: local shape [1000, 64] x tp 4 does not match checkpoint "
        "[4096, 64] in dim 0");
}

// ---------------------------------------------------------------------------
// Vocabulary padding.

TEST_CASE("Vocab padding is never written; ranks wholly in padding get none") {
  // 65 rows pad to 128; at tp 8 each rank has 16: rank 4 holds row 64 and
  // 15 padding rows, ranks 5-7 hold only padding.
  Dimensions d;
  d.vocab = 65;
  const Fixture f = LlamaFixture(d);
  const ResolvedInstance res = ResolveAndCheck(f, LlamaInstance(f, 8, d));
  const int32_t embed = f.Id("model.embed_tokens.weight");
  const ParamDecision& r4 = DecisionOf(res.ranks[4], "model.embed_tokens.weight");
  CHECK(r4.resolution == Resolution::kDirect);
  CHECK(r4.reason == "vocab shard of dim 0 (rows 64:65, 15 padding rows)");
  CHECK(PiecesOf(res.ranks[4], embed)[0].box == Box{{64, 0}, {1, 64}});
  for (int r = 5; r < 8; ++r) {
    INFO("rank " << r);
    const ParamDecision& pad = DecisionOf(res.ranks[r], "lm_head.weight");
    CHECK(pad.resolution == Resolution::kDirect);
    CHECK(pad.reason == "vocab shard of dim 0 (all 16 rows padding)");
    CHECK(pad.checkpoint_params.empty());
    CHECK(PiecesOf(res.ranks[r], embed).empty());
  }
}

TEST_CASE("A vocab shape that is not padding falls back") {
  Fixture f;
  f.Add("lm_head.weight", {1000, 64});
  auto one = [&](int tp, int64_t rows) {
    Instance inst;
    for (int r = 0; r < tp; ++r) {
      TableBuilder b(r, tp);
      b.Add("lm_head.weight", LoaderKind::kVocabParallel, {rows, 64});
      b.Finish(&inst);
    }
    const ResolvedInstance res = ResolveAndCheck(f, inst);
    CHECK(res.ranks[0].decisions[0].resolution == Resolution::kFallback);
    return res.ranks[0].decisions[0].reason;
  };
  // A replicated embedding mislabelled as vocab-parallel.
  CHECK(one(2, 1000) ==
        "fallback: local shape [1000, 64] x tp 2 holds 2000 rows for 1000: "
        "more padding than one shard or 64 rows");
  CHECK(one(8, 100) ==
        "fallback: local shape [100, 64] x tp 8 does not cover checkpoint "
        "[1000, 64] in dim 0");
}

// ---------------------------------------------------------------------------
// Block-quantized (GGUF) splits.

Instance RowSplit(const Fixture& f, const std::string& name, int tp,
                  Dims local, DType dtype, size_t dim) {
  Instance inst;
  for (int r = 0; r < tp; ++r) {
    TableBuilder b(r, tp);
    // Narrowing the storage tensor narrows whole blocks, like vLLM's GGUF
    // loader narrowing the packed byte tensor.
    const bool aligned = local.back() % BlockElems(dtype) == 0;
    b.Add(name, dim == 0 ? LoaderKind::kColumn : LoaderKind::kRow, local,
          aligned ? VllmShard(f.G(name), dim, tp, r) : Tensor{}, dtype)
        .shard_dim = static_cast<int32_t>(dim);
    b.Finish(&inst);
  }
  return inst;
}

TEST_CASE("GGUF q4_k splits land on whole blocks or fall back") {
  Fixture f;
  f.Add("down.weight", {64, 2048}, DType::kQ4_K);  // 8 blocks per row
  f.Add("odd.weight", {64, 1536}, DType::kQ4_K);   // 6 blocks per row
  f.Add("gate.weight", {128, 512}, DType::kQ4_K);

  for (int tp : {2, 4, 8}) {
    INFO("tp " << tp);
    auto res = ResolveAndCheck(
        f, RowSplit(f, "down.weight", tp, {64, 2048 / tp}, DType::kQ4_K, 1));
    CHECK(res.ranks[1].decisions[0].resolution == Resolution::kDirect);
  }
  auto col = ResolveAndCheck(
      f, RowSplit(f, "gate.weight", 4, {32, 512}, DType::kQ4_K, 0));
  CHECK(col.ranks[3].decisions[0].reason ==
        "column shard of dim 0 (rows 96:128)");
  // Storage strides count blocks: 2 blocks per row.
  CHECK(col.ranks[3].layout.pieces[0].strides == Dims{2, 1});

  // 6 blocks over 4 ranks: 1.5 blocks each.
  auto odd = ResolveAndCheck(
      f, RowSplit(f, "odd.weight", 4, {64, 384}, DType::kQ4_K, 1));
  for (const ResolvedRank& rank : odd.ranks) {
    CHECK(rank.decisions[0].resolution == Resolution::kFallback);
    CHECK(rank.decisions[0].reason ==
          "fallback: local shape [64, 384] is not whole q4_k blocks of 256 "
          "elements in dim 1");
    REQUIRE(rank.fallback.size() == 1);
    CHECK(rank.layout.pieces.size() == 1);
    CHECK(rank.layout.pieces[0].strides == Dims{6, 1});
  }
}

// ---------------------------------------------------------------------------
// Fail-closed fallbacks.

TEST_CASE("Every flag, a custom loader, a foreign tp or dtype falls back") {
  const Fixture f = LlamaFixture();
  const std::string o = L0 + "self_attn.o_proj.weight";
  struct Case {
    const char* what;
    void (*edit)(EngineParam*);
    const char* reason;
  };
  const Case cases[] = {
      {"packed", [](EngineParam* p) { p->flags = kFlagPacked; },
       "fallback: packed storage"},
      {"transposed", [](EngineParam* p) { p->flags = kFlagTransposed; },
       "fallback: transposed storage"},
      {"pre-sharded", [](EngineParam* p) { p->flags = kFlagPreSharded; },
       "fallback: checkpoint is pre-sharded"},
      {"wrapped", [](EngineParam* p) { p->flags = kFlagWrappedLoader; },
       "fallback: loader is wrapped"},
      {"transformed", [](EngineParam* p) { p->flags = kFlagTransformed; },
       "fallback: load_weights transforms it"},
      {"unknown flag", [](EngineParam* p) { p->flags = 1u << 7; },
       "fallback: unknown flags 0x80"},
      {"custom", [](EngineParam* p) { p->loader = LoaderKind::kCustom; },
       "fallback: loader is custom"},
      {"unknown loader",
       [](EngineParam* p) { p->loader = static_cast<LoaderKind>(42); },
       "fallback: loader kind 42 is unknown"},
      {"tp", [](EngineParam* p) { p->tp_size = 4; },
       "fallback: engine tp_size 4 != instance tp_size 2"},
      {"dtype", [](EngineParam* p) { p->dtype = DType::kF16; },
       "fallback: engine dtype f16 != checkpoint bf16 (loader converts)"},
      {"shard dim", [](EngineParam* p) { p->shard_dim = 0; },
       "fallback: local shape [64, 32] x tp 2 does not match checkpoint "
       "[64, 64] in dim 0"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    Instance inst = LlamaInstance(f, 2);
    for (EngineTable& t : inst.tables) {
      for (EngineParam& p : t.params) {
        if (p.name == o) c.edit(&p);
      }
    }
    const ResolvedInstance res = ResolveAndCheck(f, inst);
    for (const ResolvedRank& rank : res.ranks) {
      const ParamDecision& d = DecisionOf(rank, o);
      CHECK(d.resolution == Resolution::kFallback);
      CHECK(d.reason == c.reason);
      CHECK(d.checkpoint_params == std::vector<int32_t>{f.Id(o)});
      REQUIRE(rank.fallback.size() == 1);
      CHECK(rank.fallback[0].param == f.Id(o));
      CHECK(rank.fallback[0].staging_buffer == kStagingBufferBit);
      const auto staged = PiecesOf(rank, f.Id(o));
      REQUIRE(staged.size() == 1);
      CHECK(staged[0].buffer == kStagingBufferBit);
      CHECK(staged[0].byte_offset == 0);
      CHECK(staged[0].box == Box{{0, 0}, {64, 64}});
      CHECK(staged[0].strides == Dims{64, 1});
      // Its neighbours in other modules stay direct.
      CHECK(DecisionOf(rank, L0 + "self_attn.qkv_proj.weight").resolution ==
            Resolution::kFused);
    }
  }
}

TEST_CASE("A module with one fallback falls back whole on every rank") {
  const Fixture f = LlamaFixture();
  Instance inst = LlamaInstance(f, 2);
  // Rank 1's w2 is packed; rank 0 knows nothing about it.
  for (EngineParam& p : inst.tables[1].params) {
    if (p.name == L1 + "mlp.experts.w2_weight") p.flags = kFlagPacked;
  }
  // Rank 0's qkv bias is transformed: the qkv weight goes with it.
  for (EngineParam& p : inst.tables[0].params) {
    if (p.name == L0 + "self_attn.qkv_proj.bias") p.flags = kFlagTransformed;
  }
  const ResolvedInstance res = ResolveAndCheck(f, inst);
  const std::string experts = "fallback: module " + L1 +
                              "mlp.experts mixes direct and fallback";
  const std::string attn = "fallback: module " + L0 +
                           "self_attn.qkv_proj mixes direct and fallback";
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    const ResolvedRank& rank = res.ranks[r];
    CHECK(DecisionOf(rank, L1 + "mlp.experts.w13_weight").reason == experts);
    CHECK(DecisionOf(rank, L1 + "mlp.experts.w2_weight").reason ==
          (r == 1 ? "fallback: packed storage" : experts));
    CHECK(DecisionOf(rank, L0 + "self_attn.qkv_proj.weight").reason == attn);
    CHECK(DecisionOf(rank, L0 + "self_attn.qkv_proj.bias").reason ==
          (r == 0 ? "fallback: load_weights transforms it" : attn));
    // Other modules are untouched.
    CHECK(DecisionOf(rank, L1 + "mlp.gate.weight").resolution ==
          Resolution::kDirect);
    CHECK(DecisionOf(rank, L0 + "self_attn.o_proj.weight").resolution ==
          Resolution::kDirect);
    // Staging in first-consumed order: q,k,v weights, q,k,v biases, then
    // gate/up per expert, then down per expert.
    std::vector<int32_t> want = {
        f.Id(L0 + "self_attn.q_proj.weight"), f.Id(L0 + "self_attn.k_proj.weight"),
        f.Id(L0 + "self_attn.v_proj.weight"), f.Id(L0 + "self_attn.q_proj.bias"),
        f.Id(L0 + "self_attn.k_proj.bias"),   f.Id(L0 + "self_attn.v_proj.bias")};
    for (int e = 0; e < 4; ++e) {
      want.push_back(f.Id(Expert(e, "gate_proj")));
      want.push_back(f.Id(Expert(e, "up_proj")));
    }
    for (int e = 0; e < 4; ++e) want.push_back(f.Id(Expert(e, "down_proj")));
    std::vector<int32_t> got;
    for (const FallbackTensor& ft : rank.fallback) got.push_back(ft.param);
    CHECK(got == want);
  }
}

TEST_CASE("Loaders that consume other names: tied, shared and many") {
  Fixture f;
  f.Add("model.embed_tokens.weight", {128, 16});
  f.Add("a.weight", {8, 16});
  f.Add("b.weight", {8, 16});
  Instance inst;
  for (int r = 0; r < 2; ++r) {
    TableBuilder b(r, 2);
    b.Add("model.embed_tokens.weight", LoaderKind::kCustom, {64, 16});
    // Tied lm_head: a vocab-parallel loader reading the embedding.
    b.Add("lm_head.weight", LoaderKind::kVocabParallel, {64, 16},
          VllmVocab(f.G("model.embed_tokens.weight"), 2, r))
        .consumes = {"model.embed_tokens.weight"};
    // Two loaders that both want the embedding whole share one copy.
    b.Add("model.extra.weight", LoaderKind::kCustom, {1})
        .consumes = {"model.embed_tokens.weight", "a.weight"};
    b.Add("merged.weight", LoaderKind::kColumn, {8, 16})
        .consumes = {"a.weight", "b.weight"};
    b.Finish(&inst);
  }
  const ResolvedInstance res = ResolveAndCheck(f, inst);
  for (const ResolvedRank& rank : res.ranks) {
    CHECK(DecisionOf(rank, "lm_head.weight").resolution == Resolution::kDirect);
    CHECK(DecisionOf(rank, "lm_head.weight").checkpoint_params ==
          std::vector<int32_t>{0});
    CHECK(DecisionOf(rank, "model.extra.weight").checkpoint_params ==
          std::vector<int32_t>{0, 1});
    CHECK(DecisionOf(rank, "merged.weight").reason ==
          "fallback: loader consumes 2 checkpoint parameters");
    std::vector<int32_t> got;
    for (const FallbackTensor& ft : rank.fallback) got.push_back(ft.param);
    CHECK(got == std::vector<int32_t>{0, 1, 2});
  }
}

TEST_CASE("Tied parameters declared with alias_of are written once") {
  Fixture f;
  f.Add("model.embed_tokens.weight", {128, 16});
  f.Add("model.norm.weight", {16});
  for (const bool custom : {false, true}) {
    INFO((custom ? "embedding falls back" : "embedding direct"));
    Instance inst;
    for (int r = 0; r < 2; ++r) {
      TableBuilder b(r, 2);
      EngineParam& e = b.Add("model.embed_tokens.weight",
                             custom ? LoaderKind::kCustom
                                    : LoaderKind::kVocabParallel,
                             {64, 16},
                             VllmVocab(f.G("model.embed_tokens.weight"), 2, r));
      const EngineParam embed = e;
      b.Add("model.norm.weight", LoaderKind::kReplicated, {16},
            f.G("model.norm.weight"));
      // lm_head.weight is the embedding's storage (tie_word_embeddings); the
      // checkpoint has no lm_head.weight at all.
      EngineParam& head = b.Add("lm_head.weight", LoaderKind::kVocabParallel,
                                {64, 16});
      head.byte_offset = embed.byte_offset;
      head.alias_of = "model.embed_tokens.weight";
      b.Finish(&inst);
    }
    const ResolvedInstance res = ResolveAndCheck(f, inst);
    for (const ResolvedRank& rank : res.ranks) {
      const ParamDecision& head = DecisionOf(rank, "lm_head.weight");
      CHECK(head.resolution ==
            DecisionOf(rank, "model.embed_tokens.weight").resolution);
      CHECK(head.reason ==
            "alias of model.embed_tokens.weight: its bytes are written once, "
            "through model.embed_tokens.weight");
      CHECK(head.checkpoint_params.empty());
      // One piece (or one staging tensor) for the embedding, none for the
      // alias: no byte is written twice, which the destination check
      // proves too.
      CHECK(PiecesOf(rank, f.Id("model.embed_tokens.weight")).size() == 1);
      CHECK(rank.fallback.size() == (custom ? 1u : 0u));
      CHECK(ValidateDestination(f.model(), {rank.layout}, "tied").ok());
    }
  }
}

TEST_CASE("alias_of must name another parameter with the same bytes") {
  Fixture f;
  f.Add("model.embed_tokens.weight", {128, 16});
  auto resolve = [&](void (*edit)(EngineParam* head, EngineParam* embed)) {
    Instance inst;
    TableBuilder b(0, 1);
    b.Add("model.embed_tokens.weight", LoaderKind::kReplicated, {128, 16});
    b.Add("lm_head.weight", LoaderKind::kReplicated, {128, 16});
    b.Finish(&inst);
    EngineTable& t = inst.tables[0];
    t.params[1].byte_offset = t.params[0].byte_offset;
    t.params[1].alias_of = "model.embed_tokens.weight";
    edit(&t.params[1], &t.params[0]);
    return ResolveDestinationLayout(f.model(), inst.tables).status();
  };
  auto expect = [](const absl::Status& s, const std::string& words) {
    INFO(s.ToString());
    CHECK(s.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(s.message()).find(words) != std::string::npos);
  };
  CHECK(resolve([](EngineParam*, EngineParam*) {}).ok());
  expect(resolve([](EngineParam* h, EngineParam*) { h->alias_of = "nope"; }),
         "alias_of 'nope' names no other engine parameter of the rank");
  expect(resolve([](EngineParam* h, EngineParam*) {
           h->alias_of = "lm_head.weight";
         }),
         "names no other engine parameter");
  expect(resolve([](EngineParam* h, EngineParam*) { h->byte_offset += 64; }),
         "must be the same bytes");
  expect(resolve([](EngineParam* h, EngineParam*) {
           h->local_shape = {64, 16};
         }),
         "must be the same bytes");
  expect(resolve([](EngineParam*, EngineParam* e) {
           e->alias_of = "lm_head.weight";
         }),
         "which is an alias itself");
}

TEST_CASE("Fused parts that do not fit fall back with the reason") {
  const Fixture f = LlamaFixture();
  auto reason_of = [&](Instance inst, const std::string& name) {
    const ResolvedInstance res = ResolveAndCheck(f, inst);
    const ParamDecision& d = DecisionOf(res.ranks[0], name);
    CHECK(d.resolution == Resolution::kFallback);
    return d.reason;
  };
  auto edit = [](Instance* inst, const std::string& name,
                 void (*fn)(EngineParam*)) {
    for (EngineTable& t : inst->tables) {
      for (EngineParam& p : t.params) {
        if (p.name == name) fn(&p);
      }
    }
  };
  const std::string qkv = L0 + "self_attn.qkv_proj.weight";
  const std::string w13 = L1 + "mlp.experts.w13_weight";

  // Without the kv parts' local rows, 2 kv heads at tp 4 look like 4-row
  // slices of a head: the rows do not add up.
  CHECK(reason_of(LlamaInstance(f, 4, {}, /*declare_kv=*/false), qkv) ==
        "fallback: fused parts give 24 rows but local shape [32, 64] has 32 "
        "in dim 0");

  Instance inst = LlamaInstance(f, 4);
  edit(&inst, qkv, [](EngineParam* p) {
    std::vector<FusedPart> parts = p->parts.get();
    parts[1].local_extent = 6;
    parts[2].local_extent = 6;
    p->parts = parts;
    p->local_shape = {28, 64};
  });
  CHECK(reason_of(inst, qkv) ==
        "fallback: part " + L0 +
            "self_attn.k_proj.weight: 6 local rows x tp 4 do not replicate "
            "its 16 rows over whole groups of ranks");

  inst = LlamaInstance(f, 2);
  edit(&inst, w13, [](EngineParam* p) {
    p->parts = std::vector<FusedPart>(p->parts.begin(), p->parts.begin() + 6);
  });
  CHECK(reason_of(inst, w13) ==
        "fallback: fused parts fill 3 of 4 lead slots of local shape "
        "[4, 32, 64]");

  inst = LlamaInstance(f, 2);
  edit(&inst, w13, [](EngineParam* p) {
    std::vector<FusedPart> parts = p->parts.get();
    parts[7].lead_index = {4};
    p->parts = parts;
  });
  CHECK(reason_of(inst, w13) == "fallback: part " + Expert(3, "up_proj") +
                                    " lead index [4] lies outside local "
                                    "shape [4, 32, 64]");

  inst = LlamaInstance(f, 2);
  edit(&inst, w13, [](EngineParam* p) { p->dtype = DType::kF16; });
  CHECK(reason_of(inst, w13) ==
        "fallback: engine dtype f16 != checkpoint bf16 (loader converts) in "
        "part " + Expert(0, "gate_proj"));

  inst = LlamaInstance(f, 2);
  edit(&inst, w13, [](EngineParam* p) { p->local_shape = {4, 32, 60}; });
  CHECK(reason_of(inst, w13) == "fallback: part " + Expert(0, "gate_proj") +
                                    " shape [32, 64] does not match local "
                                    "shape [4, 32, 60] in dim 2");
}

// ---------------------------------------------------------------------------
// Errors: the table and the model disagree.

void ExpectError(const Fixture& f, const std::vector<EngineTable>& tables,
                 const std::vector<std::string>& mentions) {
  auto res = ResolveDestinationLayout(f.model(), tables);
  REQUIRE_FALSE(res.ok());
  CHECK(res.status().code() == absl::StatusCode::kInvalidArgument);
  const std::string msg(res.status().message());
  for (const std::string& m : mentions) {
    INFO("message: " << msg);
    CHECK(msg.find(m) != std::string::npos);
  }
}

TEST_CASE("Table-set errors name the rank") {
  const Fixture f = LlamaFixture();
  Instance inst = LlamaInstance(f, 2);
  std::vector<EngineTable> dup = {inst.tables[1], inst.tables[1]};
  ExpectError(f, dup, {"duplicate", "rank 1"});
  ExpectError(f, {inst.tables[1]}, {"missing", "rank 0"});
  std::vector<EngineTable> sizes = inst.tables;
  sizes[1].tp_size = 4;
  ExpectError(f, sizes, {"tp_size", "rank 1"});
  std::vector<EngineTable> range = inst.tables;
  range[1].tp_rank = 2;
  ExpectError(f, range, {"rank 2"});
  ExpectError(f, {}, {"no engine tables"});
}

TEST_CASE("Parameter errors name the parameter, the rank and the shape") {
  const Fixture f = LlamaFixture();
  const std::string o = L0 + "self_attn.o_proj.weight";
  const std::string qkv = L0 + "self_attn.qkv_proj.weight";
  auto on_rank1 = [&](const std::string& name,
                      const std::function<void(EngineParam*)>& fn,
                      std::vector<std::string> mentions) {
    Instance inst = LlamaInstance(f, 2);
    for (EngineParam& p : inst.tables[1].params) {
      if (p.name != name) continue;
      fn(&p);
      mentions.push_back(p.name);  // as edited: some edits rename it
    }
    mentions.push_back("rank 1");
    ExpectError(f, inst.tables, mentions);
  };
  // Each edit changes rank 1's own copy of the parts; the list itself is
  // shared with rank 0's and never changes in place.
  auto set_part = [](EngineParam* p, size_t i, auto&& edit_part) {
    std::vector<FusedPart> parts = p->parts.get();
    edit_part(&parts[i]);
    p->parts = parts;
  };
  on_rank1(qkv,
           [&](EngineParam* p) {
             set_part(p, 1, [](FusedPart* part) { part->checkpoint_name = "nope"; });
           },
           {"fused part 'nope' is not a checkpoint parameter"});
  on_rank1(qkv,
           [&](EngineParam* p) {
             set_part(p, 1, [](FusedPart* part) { part->local_extent = -8; });
           },
           {"negative local extent -8"});
  on_rank1(o, [](EngineParam* p) { p->consumes = {"nope.weight"}; },
           {"consumes 'nope.weight'"});
  on_rank1(o,
           [](EngineParam* p) {
             p->name = "model.custom.thing";
             p->loader = LoaderKind::kCustom;
           },
           {"consumes nothing the checkpoint has"});
  on_rank1(o, [](EngineParam* p) { p->name = "model.renamed.weight"; },
           {"consumes nothing the checkpoint has"});
  on_rank1(o, [](EngineParam* p) { p->local_shape = {-1, 32}; },
           {"[-1, 32]", "negative"});
  on_rank1(o,
           [](EngineParam* p) {
             p->local_shape = {int64_t{1} << 40, int64_t{1} << 30};
           },
           {"[1099511627776, 1073741824]"});
  on_rank1(o, [](EngineParam* p) { p->byte_offset = int64_t{1} << 40; },
           {"[64, 32]", "past the end of buffer 0"});
  on_rank1(o, [](EngineParam* p) { p->byte_offset = -2; },
           {"negative byte offset"});
  on_rank1(o, [](EngineParam* p) { p->buffer = 3; },
           {"buffer 3 is not registered"});
  on_rank1(o, [](EngineParam* p) { p->dtype = DType::kInvalid; },
           {"no valid dtype"});

  Instance inst = LlamaInstance(f, 2);
  const EngineParam twice = inst.tables[1].params[3];
  inst.tables[1].params.push_back(twice);
  ExpectError(f, inst.tables, {twice.name, "rank 1", "appears twice"});

  // Without registered sizes, the buffer bound is not checked.
  inst = LlamaInstance(f, 2);
  for (EngineTable& t : inst.tables) t.buffer_bytes.clear();
  CHECK(ResolveDestinationLayout(f.model(), inst.tables).ok());
}

TEST_CASE("With errors on several ranks, the lowest rank's first is "
          "returned, however the ranks are shared out between threads") {
  // Ranks are decided in groups on PlanningThreads() workers: at TP 8 on
  // two or more threads, ranks 2 and 6 fall in different groups.
  const Fixture f = LlamaFixture();
  const std::string o = L0 + "self_attn.o_proj.weight";
  const std::string down = L0 + "mlp.down_proj.weight";
  Instance inst = LlamaInstance(f, 8);
  auto edit_rank = [&](int rank, const std::string& name,
                       const std::function<void(EngineParam*)>& fn) {
    for (EngineParam& p : inst.tables[rank].params) {
      if (p.name == name) fn(&p);
    }
  };
  // Rank 6 fails on an earlier parameter than rank 2 does.
  edit_rank(6, o, [](EngineParam* p) { p->byte_offset = -6; });
  edit_rank(2, down, [](EngineParam* p) { p->byte_offset = -2; });
  edit_rank(2, o, [](EngineParam* p) { p->buffer = 3; });
  for (int threads : {1, 2, 3, 8}) {
    SetPlanningThreads(threads);
    auto res = ResolveDestinationLayout(f.model(), inst.tables);
    SetPlanningThreads(0);
    REQUIRE_FALSE(res.ok());
    const std::string msg(res.status().message());
    INFO("message: " << msg << " (planning threads: " << threads << ")");
    CHECK(msg.find("rank 2") != std::string::npos);
    CHECK(msg.find("buffer 3 is not registered") != std::string::npos);
    CHECK(msg.find(o) != std::string::npos);
  }
}

// Everything a resolution decides for one instance, as text.
std::string Describe(const ResolvedInstance& res) {
  std::ostringstream out;
  for (const ResolvedRank& r : res.ranks) {
    out << "rank " << r.layout.rank << "\n";
    for (const Piece& p : r.layout.pieces) {
      out << " piece " << p.param << " buf " << p.buffer << " at "
          << p.byte_offset << " box";
      for (int64_t v : p.box.offset) out << " " << v;
      out << " +";
      for (int64_t v : p.box.extent) out << " " << v;
      out << " strides";
      for (int64_t v : p.strides) out << " " << v;
      out << "\n";
    }
    for (const FallbackTensor& t : r.fallback) {
      out << " fallback " << t.param << " in " << t.staging_buffer << "\n";
    }
    for (const ParamDecision& d : r.decisions) {
      out << " " << d.engine_name << " " << ResolutionName(d.resolution)
          << " (" << d.reason << ")";
      for (int32_t c : d.checkpoint_params) out << " " << c;
      out << "\n";
    }
  }
  return out.str();
}

TEST_CASE("The resolution is the same on any number of threads") {
  const Fixture f = LlamaFixture();
  for (int tp : {2, 8}) {
    Instance inst = LlamaInstance(f, tp);
    // One rank falls back on a parameter, so that the module's other ranks
    // must follow it (a decision taken across ranks).
    for (EngineParam& p : inst.tables[tp - 1].params) {
      if (p.name == L0 + "self_attn.o_proj.weight") p.flags = kFlagPacked;
    }
    SetPlanningThreads(1);
    auto one = ResolveDestinationLayout(f.model(), inst.tables);
    REQUIRE(one.ok());
    const std::string expected = Describe(*one);
    CHECK(expected.find("fallback") != std::string::npos);
    for (int threads : {2, 3, 8}) {
      INFO("tp " << tp << ", threads " << threads);
      SetPlanningThreads(threads);
      auto many = ResolveDestinationLayout(f.model(), inst.tables);
      REQUIRE(many.ok());
      CHECK(Describe(*many) == expected);
    }
    SetPlanningThreads(0);
  }
}

TEST_CASE("ResolutionName") {
  CHECK(std::string(ResolutionName(Resolution::kDirect)) == "direct");
  CHECK(std::string(ResolutionName(Resolution::kFused)) == "fused");
  CHECK(std::string(ResolutionName(Resolution::kFallback)) == "fallback");
}

}  // namespace
}  // namespace ferry
