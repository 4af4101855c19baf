// A GGUF checkpoint of block-quantized tensors (Q8_0, Q4_K, Q6_K: real
// quantizations of known matrices, in ggml's block layouts) published
// through ferryd into a TP 2 and a TP 4 instance whose live tensors are
// quantized, as vLLM shards GGUF weights (seed 001): column-parallel
// tensors split into whole rows, row-parallel ones along ne[0] on whole
// blocks, and a split that would fall inside a block goes to the engine's
// loader as the whole tensor. Each engine rank is a real DestinationClient
// with its tensors in shared memory; its bytes are checked against the
// file's bytes of its share, sliced here from what the test wrote, and
// dequantized against the matrix they were made from.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "checkpoint/checkpoint.h"
#include "client/checkpoint_source.h"
#include "client/connection.h"
#include "client/destination_client.h"
#include "client/shared_tensor_arena.h"
#include "tests/checkpoint/checkpoint_writers.h"
#include "tests/daemon/daemon_test_support.h"

namespace ferry {
namespace testing {
namespace {

constexpr uint32_t kQ8_0 = 8, kQ4_K = 12, kQ6_K = 14, kF32 = 0;

std::vector<float> Noise(int64_t n, uint32_t seed) {
  std::vector<float> m;
  uint32_t x = seed * 2654435761u + 7;
  for (int64_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    m.push_back(static_cast<float>(x >> 8) / static_cast<float>(1 << 23) - 1.0f);
  }
  return m;
}

// How the engine's loader splits a tensor, as vLLM's linear layers do.
enum class Split { kRows, kColumns, kWhole };

// One tensor of the test model: rows x cols (row-major, as ferry and the
// Hugging Face checkpoint see it; GGUF ne = {cols, rows}).
struct Tensor {
  std::string gguf_name, hf_name;
  uint32_t ggml_type;
  DType dtype;
  int64_t rows, cols;  // cols = 0: a vector of `rows`
  Split split;
  LoaderKind loader;
  int64_t block_elems, block_bytes;
};

const std::vector<Tensor>& Model() {
  static const std::vector<Tensor> m = {
      {"token_embd.weight", "model.embed_tokens.weight", kQ8_0, DType::kQ8_0,
       32, 64, Split::kRows, LoaderKind::kVocabParallel, 32, 34},
      {"blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", kQ8_0,
       DType::kQ8_0, 16, 64, Split::kRows, LoaderKind::kColumn, 32, 34},
      // 4 Q4_K blocks per row: TP 2 two each, TP 4 one each.
      {"blk.0.attn_output.weight", "model.layers.0.self_attn.o_proj.weight",
       kQ4_K, DType::kQ4_K, 8, 1024, Split::kColumns, LoaderKind::kRow, 256, 144},
      // 2 Q6_K blocks per row: TP 2 one each; TP 4 would cut a block.
      {"blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight", kQ6_K,
       DType::kQ6_K, 8, 512, Split::kColumns, LoaderKind::kRow, 256, 210},
      {"output_norm.weight", "model.norm.weight", kF32, DType::kF32, 64, 0,
       Split::kWhole, LoaderKind::kReplicated, 1, 4},
  };
  return m;
}

int64_t Elems(const Tensor& t) { return t.rows * std::max<int64_t>(t.cols, 1); }
int64_t RowBytes(const Tensor& t) { return t.cols / t.block_elems * t.block_bytes; }

struct File {
  std::string path;
  std::vector<std::vector<float>> values;  // per tensor, what was quantized
  std::vector<Bytes> bytes;                // per tensor, as in the file
};

File WriteGguf(uint32_t seed) {
  File f;
  GgufWriter w;
  w.String("general.architecture", "llama");
  w.U32("llama.attention.head_count_kv", 4);
  for (const Tensor& t : Model()) {
    std::vector<float> v = Noise(Elems(t), seed++);
    Bytes b;
    switch (t.ggml_type) {
      case kQ8_0: b = QuantizeQ8_0(v); break;
      case kQ4_K: b = QuantizeQ4_K(v); break;
      case kQ6_K: b = QuantizeQ6_K(v); break;
      default:
        b.resize(v.size() * 4);
        std::memcpy(b.data(), v.data(), b.size());
    }
    std::vector<uint64_t> ne = t.cols ? std::vector<uint64_t>{uint64_t(t.cols), uint64_t(t.rows)}
                                      : std::vector<uint64_t>{uint64_t(t.rows)};
    w.Tensor(t.gguf_name, t.ggml_type, ne, b);
    f.values.push_back(std::move(v));
    f.bytes.push_back(std::move(b));
  }
  f.path = TempDir() + "/model-" + std::to_string(seed) + ".gguf";
  WriteFile(f.path, w.Build());
  return f;
}

// Rank r's share of tensor t's file bytes, sliced from the bytes the test
// wrote (not from the planner): whole rows, or every row's columns.
Bytes ShareOf(const Tensor& t, const Bytes& file, int tp, int r) {
  if (t.split == Split::kWhole || tp == 1) return file;
  if (t.split == Split::kRows) {
    const int64_t per = file.size() / tp;
    return Bytes(file.begin() + r * per, file.begin() + (r + 1) * per);
  }
  Bytes out;
  const int64_t row = RowBytes(t), per = row / tp;
  for (int64_t i = 0; i < t.rows; ++i) {
    out.insert(out.end(), file.begin() + i * row + r * per,
               file.begin() + i * row + (r + 1) * per);
  }
  return out;
}

bool SplitsOnBlocks(const Tensor& t, int tp) {
  return t.split != Split::kColumns || (t.cols / tp) % t.block_elems == 0;
}

// One engine rank: its live quantized tensors in shared memory, a table
// declaring them as vLLM's loaders place them, and a loader that keeps the
// whole tensors it is handed.
struct Engine {
  std::unique_ptr<SharedTensorArena> arena;
  std::vector<TensorSlot> slots;  // per tensor
  std::unique_ptr<DestinationClient> client;
  std::mutex mu;
  std::map<std::string, Bytes> loaded;  // fallback tensors, by HF name
  std::map<std::string, std::string> loaded_dtype;

  Bytes Live(size_t i) const {
    return Bytes(slots[i].data, slots[i].data + slots[i].size_bytes);
  }
};

std::unique_ptr<Engine> StartEngine(const Connection& c, const std::string& id,
                                    int tp, int r) {
  auto e = std::make_unique<Engine>();
  auto arena = SharedTensorArena::Create(absl::StrCat("q.", id, ".", r), 1 << 20, 0);
  REQUIRE(arena.ok());
  e->arena = *std::move(arena);
  EngineTable table;
  for (const Tensor& t : Model()) {
    EngineParam p;
    p.name = t.hf_name;
    p.dtype = t.dtype;
    p.loader = t.loader;
    p.tp_size = tp;
    if (t.split == Split::kWhole) {
      p.local_shape = {t.rows};
    } else if (t.split == Split::kRows) {
      p.local_shape = {t.rows / tp, t.cols};
      p.shard_dim = 0;
    } else {
      p.local_shape = {t.rows, t.cols / tp};
      p.shard_dim = 1;
    }
    // Storage of the local tensor: whole blocks per row, rounded up where
    // the split cuts a block (that tensor goes to the loader instead).
    const int64_t inner = p.local_shape.back();
    const int64_t units = (inner + t.block_elems - 1) / t.block_elems;
    const int64_t outer = p.local_shape.size() == 2 ? p.local_shape[0] : 1;
    auto slot = e->arena->Allocate(outer * units * t.block_bytes);
    REQUIRE(slot.ok());
    std::memset(slot->data, 0xab, slot->size_bytes);
    p.buffer = 0;
    p.byte_offset = slot->byte_offset;
    e->slots.push_back(*slot);
    table.params.push_back(p);
  }
  DestinationOptions o;
  o.instance_id = id;
  o.stream = "gguf";
  o.tp_rank = r;
  o.tp_size = tp;
  DestinationCallbacks cb;
  Engine* raw = e.get();
  cb.on_apply = [raw](int64_t, const std::vector<FallbackTensorView>& tensors) {
    std::lock_guard<std::mutex> lock(raw->mu);
    for (const FallbackTensorView& t : tensors) {
      raw->loaded[t.parameter] = Bytes(t.bytes.begin(), t.bytes.end());
      raw->loaded_dtype[t.parameter] = DTypeName(t.dtype);
    }
    return absl::OkStatus();
  };
  auto client = DestinationClient::Register(
      c, o, DestinationLayout::FromEngineTable(table, {e->arena->Describe()}), cb);
  INFO(client.status().ToString());
  REQUIRE(client.ok());
  e->client = *std::move(client);
  return e;
}

std::vector<float> Dequantize(const Tensor& t, const Bytes& b, int64_t values) {
  switch (t.ggml_type) {
    case kQ8_0: return DequantizeQ8_0(b.data(), values);
    case kQ4_K: return DequantizeQ4_K(b.data(), values);
    case kQ6_K: return DequantizeQ6_K(b.data(), values);
  }
  std::vector<float> f(values);
  std::memcpy(f.data(), b.data(), values * 4);
  return f;
}

// The matrix's share of rank r, as floats.
std::vector<float> ValuesOf(const Tensor& t, const std::vector<float>& v, int tp, int r) {
  if (t.split == Split::kWhole || tp == 1) return v;
  if (t.split == Split::kRows) {
    const int64_t per = v.size() / tp;
    return std::vector<float>(v.begin() + r * per, v.begin() + (r + 1) * per);
  }
  std::vector<float> out;
  const int64_t per = t.cols / tp;
  for (int64_t i = 0; i < t.rows; ++i) {
    out.insert(out.end(), v.begin() + i * t.cols + r * per,
               v.begin() + i * t.cols + (r + 1) * per);
  }
  return out;
}

// Every rank of every instance holds the file's bytes of its share (and
// those dequantize to the matrix's share); a tensor whose split cuts a
// block reached the loader whole, byte for byte.
void ExpectHolds(const std::map<std::string, std::vector<std::unique_ptr<Engine>>>& fleet,
                 const File& f) {
  for (const auto& [id, ranks] : fleet) {
    const int tp = ranks.size();
    for (int r = 0; r < tp; ++r) {
      Engine& e = *ranks[r];
      for (size_t i = 0; i < Model().size(); ++i) {
        const Tensor& t = Model()[i];
        INFO(id << " tp rank " << r << ": " << t.hf_name << " (" << DTypeName(t.dtype) << ")");
        if (!SplitsOnBlocks(t, tp)) {
          std::lock_guard<std::mutex> lock(e.mu);
          REQUIRE(e.loaded.count(t.hf_name) == 1);
          CHECK(e.loaded.at(t.hf_name) == f.bytes[i]);
          CHECK(e.loaded_dtype.at(t.hf_name) == DTypeName(t.dtype));
          continue;
        }
        const Bytes want = ShareOf(t, f.bytes[i], tp, r);
        const Bytes got = e.Live(i);
        REQUIRE(got.size() == want.size());
        CHECK(got == want);
        const std::vector<float> expect = ValuesOf(t, f.values[i], tp, r);
        const std::vector<float> value = Dequantize(t, got, expect.size());
        float worst = 0;
        for (size_t k = 0; k < expect.size(); ++k) {
          worst = std::max(worst, std::fabs(value[k] - expect[k]));
        }
        CHECK(worst < 0.1f);  // Q4_K's error bound; the others are tighter
      }
    }
  }
}

TEST_CASE("A quantized GGUF checkpoint into TP 2 and TP 4 instances with "
          "quantized live tensors: every rank the file's bytes of its share") {
  TestDaemon d;
  ConnectionOptions co;
  co.address = "unix:" + d.options.socket_path;
  auto c = Connection::Open(co);
  REQUIRE(c.ok());
  std::map<std::string, std::vector<std::unique_ptr<Engine>>> fleet;
  for (int tp : {2, 4}) {
    const std::string id = absl::StrCat("gguf-tp", tp);
    for (int r = 0; r < tp; ++r) fleet[id].push_back(StartEngine(*c, id, tp, r));
  }

  for (int64_t v : {1, 2}) {
    const File f = WriteGguf(100 * v);
    absl::StatusOr<Checkpoint> ckpt = OpenCheckpoint(f.path);
    REQUIRE(ckpt.ok());
    CheckpointPublishOptions o;
    o.stream = "gguf";
    o.version = v;
    o.wait_for_instances = absl::Seconds(10);
    absl::StatusOr<PublishOutcome> out = PublishCheckpoint(*c, *ckpt, o);
    INFO(out.status().ToString());
    REQUIRE(out.ok());
    INFO(out->Summary());
    CHECK(out->instances.size() == 2);
    REQUIRE(out->all_committed());
    for (auto& [id, ranks] : fleet) {
      for (auto& e : ranks) REQUIRE(e->client->AwaitCommitted(v, absl::Seconds(10)).ok());
    }
    ExpectHolds(fleet, f);
  }

  // What went to the loader, and why: only TP 4's ffn_down, whose split
  // (128 columns) would fall inside a 256-element Q6_K block.
  for (auto& [id, ranks] : fleet) {
    std::lock_guard<std::mutex> lock(ranks[0]->mu);
    if (id == "gguf-tp4") {
      CHECK(ranks[0]->loaded.size() == 1);
      CHECK(ranks[0]->loaded.count("model.layers.0.mlp.down_proj.weight") == 1);
    } else {
      CHECK(ranks[0]->loaded.empty());
    }
  }
}

}  // namespace
}  // namespace testing
}  // namespace ferry
