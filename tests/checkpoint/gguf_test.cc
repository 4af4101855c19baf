// checkpoint/gguf.h against files this test writes from the GGUF
// specification (checkpoint_writers.h): every metadata value type, tensors
// of plain and block-quantized ggml types with their bytes where the
// header says, ne reversed into row-major shapes, and each malformed input
// refused with an error that names the file, the tensor and the byte.
#include "checkpoint/gguf.h"

#include <cmath>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "checkpoint/checkpoint.h"
#include "tests/checkpoint/checkpoint_writers.h"

namespace ferry {
namespace testing {
namespace {

std::vector<float> Ramp(int n, float scale) {
  std::vector<float> v;
  for (int i = 0; i < n; ++i) v.push_back(scale * std::sin(0.37f * i + 0.1f));
  return v;
}

Bytes Raw(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + 31 * i);
  return b;
}

std::string Write(const std::string& name, const Bytes& bytes) {
  const std::string path = TempDir() + "/" + name;
  WriteFile(path, bytes);
  return path;
}

std::string Error(const Bytes& bytes) {
  absl::StatusOr<GgufFile> g = ReadGguf(Write("bad.gguf", bytes));
  REQUIRE_FALSE(g.ok());
  CHECK(g.status().code() == absl::StatusCode::kInvalidArgument);
  return std::string(g.status().message());
}

bool Has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

TEST_CASE("GGUF: metadata of every value type, tensors where the header "
          "says, shapes row-major") {
  GgufWriter w;
  w.String("general.architecture", "llama");
  w.U32("general.alignment", 64);
  w.U8("t.u8", 200);
  w.I8("t.i8", -100);
  w.U16("t.u16", 60000);
  w.I16("t.i16", -30000);
  w.I32("t.i32", -2000000000);
  w.F32("t.f32", 1.5f);
  w.Bool("t.bool", true);
  w.U64("t.u64", uint64_t{1} << 40);
  w.I64("t.i64", -(int64_t{1} << 40));
  w.F64("t.f64", 0.25);
  w.StringArray("tokenizer.ggml.tokens", {"<s>", "</s>", "hello"});
  w.I32Array("t.ints", {1, -2, 3});
  w.NestedU32Array("t.nested", {{1, 2}, {3}});
  const std::vector<float> q8 = Ramp(4 * 64, 3.0f);
  const std::vector<float> q4 = Ramp(2 * 32, 0.5f);
  const Bytes f32 = Raw(2 * 3 * 4, 1);
  const Bytes q8_bytes = QuantizeQ8_0(q8);
  const Bytes q4_bytes = QuantizeQ4_0(q4);
  const Bytes q4k = Raw(2 * 144, 7);
  const Bytes q6k = Raw(1 * 210, 9);
  const Bytes bf16 = Raw(8 * 2, 3);
  w.Tensor("blk.0.attn_norm.weight", 0, {3, 2}, f32);
  w.Tensor("blk.0.attn_q.weight", 8, {64, 4}, q8_bytes);
  w.Tensor("blk.0.ffn_down.weight", 2, {32, 2}, q4_bytes);
  w.Tensor("blk.0.ffn_up.weight", 12, {256, 2}, q4k);
  w.Tensor("output.weight", 14, {256, 1}, q6k);
  w.Tensor("token_embd.weight", 30, {4, 2}, bf16);
  const std::string path = Write("model.gguf", w.Build(64));
  absl::StatusOr<GgufFile> g = ReadGguf(path);
  INFO(g.status().ToString());
  REQUIRE(g.ok());
  CHECK(g->version == 3);
  CHECK(g->alignment == 64);
  CHECK(g->data_offset % 64 == 0);
  CHECK(std::get<std::string>(g->metadata["general.architecture"].value) == "llama");
  CHECK(std::get<uint64_t>(g->metadata["t.u8"].value) == 200);
  CHECK(std::get<int64_t>(g->metadata["t.i8"].value) == -100);
  CHECK(std::get<uint64_t>(g->metadata["t.u16"].value) == 60000);
  CHECK(std::get<int64_t>(g->metadata["t.i16"].value) == -30000);
  CHECK(std::get<int64_t>(g->metadata["t.i32"].value) == -2000000000);
  CHECK(std::get<double>(g->metadata["t.f32"].value) == 1.5);
  CHECK(std::get<bool>(g->metadata["t.bool"].value));
  CHECK(std::get<uint64_t>(g->metadata["t.u64"].value) == uint64_t{1} << 40);
  CHECK(std::get<int64_t>(g->metadata["t.i64"].value) == -(int64_t{1} << 40));
  CHECK(std::get<double>(g->metadata["t.f64"].value) == 0.25);
  const auto& tokens =
      std::get<std::vector<GgufValue>>(g->metadata["tokenizer.ggml.tokens"].value);
  REQUIRE(tokens.size() == 3);
  CHECK(std::get<std::string>(tokens[2].value) == "hello");
  const auto& nested = std::get<std::vector<GgufValue>>(g->metadata["t.nested"].value);
  REQUIRE(nested.size() == 2);
  CHECK(std::get<uint64_t>(
            std::get<std::vector<GgufValue>>(nested[0].value)[1].value) == 2);
  CHECK(g->checkpoint.metadata["general.architecture"] == "llama");

  const Checkpoint& c = g->checkpoint;
  REQUIRE(c.tensors.size() == 6);
  struct Want {
    const char* name;
    DType dtype;
    const char* type;
    Dims shape;
    const Bytes* bytes;
  };
  const Want want[] = {
      {"blk.0.attn_norm.weight", DType::kF32, "F32", {2, 3}, &f32},
      {"blk.0.attn_q.weight", DType::kQ8_0, "Q8_0", {4, 64}, &q8_bytes},
      {"blk.0.ffn_down.weight", DType::kQ4_0, "Q4_0", {2, 32}, &q4_bytes},
      {"blk.0.ffn_up.weight", DType::kQ4_K, "Q4_K", {2, 256}, &q4k},
      {"output.weight", DType::kQ6_K, "Q6_K", {1, 256}, &q6k},
      {"token_embd.weight", DType::kBF16, "BF16", {2, 4}, &bf16},
  };
  for (const Want& x : want) {
    INFO(x.name);
    const int32_t i = c.Find(x.name);
    REQUIRE(i >= 0);
    const CheckpointTensor& t = c.tensors[i];
    CHECK(t.dtype == x.dtype);
    CHECK(t.file_type == x.type);
    CHECK(t.shape == x.shape);
    CHECK(t.bytes == static_cast<int64_t>(x.bytes->size()));
    CHECK(t.offset % 64 == 0);
    CHECK(std::memcmp(c.Data(t), x.bytes->data(), x.bytes->size()) == 0);
  }
  // The quantized bytes decode to the floats they were made from, within
  // half a quantization step (ggml's reference rounding).
  const CheckpointTensor& tq8 = c.tensors[c.Find("blk.0.attn_q.weight")];
  const std::vector<float> back8 = DequantizeQ8_0(c.Data(tq8), 256);
  for (size_t i = 0; i < q8.size(); ++i) {
    CHECK(std::fabs(back8[i] - q8[i]) <= 3.0f / 127 * 0.51f + 1e-3f);
  }
  const CheckpointTensor& tq4 = c.tensors[c.Find("blk.0.ffn_down.weight")];
  const std::vector<float> back4 = DequantizeQ4_0(c.Data(tq4), 64);
  for (size_t i = 0; i < q4.size(); ++i) {
    CHECK(std::fabs(back4[i] - q4[i]) <= 0.5f / 8 * 1.01f + 1e-3f);
  }
  // OpenCheckpoint tells a GGUF file by its magic.
  absl::StatusOr<Checkpoint> opened = OpenCheckpoint(path);
  REQUIRE(opened.ok());
  CHECK(opened->tensors.size() == 6);
}

TEST_CASE("GGUF: the default alignment is 32; version 2 reads the same") {
  GgufWriter w(2);
  w.Tensor("a", 0, {5}, Raw(20, 1));
  w.Tensor("b", 0, {3}, Raw(12, 2));
  absl::StatusOr<GgufFile> g = ReadGguf(Write("v2.gguf", w.Build(32)));
  REQUIRE(g.ok());
  CHECK(g->alignment == 32);
  CHECK(g->checkpoint.tensors[1].offset == g->data_offset + 32);
}

TEST_CASE("GGUF: malformed files are refused, naming the file, tensor and "
          "byte") {
  auto one = [](uint32_t type, std::vector<uint64_t> ne, Bytes data,
                int64_t offset = -1) {
    GgufWriter w;
    w.Tensor("blk.0.attn_q.weight", type, ne, data, offset);
    return w.Build();
  };
  SECTION("magic") {
    Bytes b = one(0, {4}, Raw(16, 1));
    b[0] = 'X';
    CHECK(Has(Error(b), "not a GGUF file"));
  }
  SECTION("version") {
    Bytes b = one(0, {4}, Raw(16, 1));
    b[4] = 4;
    CHECK(Has(Error(b), "GGUF version 4 at byte 4"));
  }
  SECTION("truncated in the tensor infos") {
    Bytes b = one(0, {4}, Raw(16, 1));
    b.resize(60);  // in ne[0] of the first tensor info (at byte 55)
    const std::string e = Error(b);
    CHECK(Has(e, "truncated at byte 55: tensor 'blk.0.attn_q.weight' (info "
                 "at byte 24): ne[0] needs 8 bytes"));
    CHECK(Has(e, "bad.gguf"));
  }
  SECTION("data past the end of the file") {
    Bytes b = one(0, {4}, Raw(16, 1));
    b.resize(b.size() - 16 - 8);  // the padding and half the data
    const std::string e = Error(b);
    CHECK(Has(e, "tensor 'blk.0.attn_q.weight' (info at byte 24): data"));
    CHECK(Has(e, "runs past the end of the file"));
  }
  SECTION("misaligned offset") {
    CHECK(Has(Error(one(0, {4}, Raw(16, 1), 4)),
              "data offset 4 is not a multiple of the alignment 32"));
  }
  SECTION("overlapping tensors") {
    GgufWriter w;
    w.Tensor("a", 0, {16}, Raw(64, 1));
    w.Tensor("b", 0, {16}, Raw(64, 2), 32);
    CHECK(Has(Error(w.Build()), "tensors 'a' and 'b' share bytes"));
  }
  SECTION("no dims, five dims") {
    CHECK(Has(Error(one(0, {}, Raw(4, 1))), "0 dims; 1 to 4 are allowed"));
    CHECK(Has(Error(one(0, {1, 1, 1, 1, 1}, Raw(4, 1))), "5 dims"));
  }
  SECTION("unknown ggml type") {
    CHECK(Has(Error(one(16, {256}, Raw(66, 1))), "ggml type 16 is not read"));
  }
  SECTION("ne[0] not a whole number of blocks") {
    CHECK(Has(Error(one(2, {33}, Raw(18, 1))),
              "ne[0] = 33 is not a whole number of Q4_0 blocks (32 elements)"));
  }
  SECTION("a name twice") {
    GgufWriter w;
    w.Tensor("a", 0, {4}, Raw(16, 1));
    w.Tensor("a", 0, {4}, Raw(16, 2));
    CHECK(Has(Error(w.Build()), "tensor 'a' (info at byte"));
  }
  SECTION("a string longer than the file") {
    GgufWriter w;
    w.String("k", "v");
    Bytes b = w.Build();
    b[24 + 8 + 1 + 4] = 0xff;  // the value's length, low byte
    b[24 + 8 + 1 + 4 + 6] = 0x7f;
    CHECK(Has(Error(b), "claims"));
  }
  SECTION("an array count the file cannot hold") {
    GgufWriter w;
    w.I32Array("k", {1});
    Bytes b = w.Build();
    b[24 + 8 + 1 + 4 + 4 + 7] = 0x7f;  // the count's top byte
    CHECK(Has(Error(b), "does not fit"));
  }
  SECTION("counts the file cannot hold") {
    Bytes b = one(0, {4}, Raw(16, 1));
    b[8 + 7] = 0x10;  // tensor_count's top byte
    CHECK(Has(Error(b), "cannot fit in the"));
  }
  SECTION("a bad alignment") {
    GgufWriter w;
    w.U32("general.alignment", 48);
    CHECK(Has(Error(w.Build()), "general.alignment 48 is not a power of two"));
  }
}

}  // namespace
}  // namespace testing
}  // namespace ferry
