// The //tools:ferry_load binary's --explain, as a person and a script run
// it: on a sharded safetensors checkpoint (model.safetensors.index.json and
// two shards) and on a GGUF file, at TP 2. The JSON is parsed and every
// rank's byte ranges are checked against offsets computed here from the
// files' own headers (8-byte length + JSON for safetensors; the data
// offsets the test's GGUF writer laid out), not from the planner.
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "catch2/catch.hpp"
#include "nlohmann/json.hpp"
#include "tests/checkpoint/checkpoint_writers.h"

namespace ferry {
namespace testing {
namespace {

std::string FerryLoad() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  return std::string(srcdir == nullptr ? "." : srcdir) + "/ferry/tools/ferry_load";
}

// Runs ferry_load with `args`; its stdout, and its exit status in `rc`.
std::string Run(const std::string& args, int* rc) {
  const std::string cmd = FerryLoad() + " " + args + " 2>/dev/null";
  FILE* p = ::popen(cmd.c_str(), "r");
  REQUIRE(p != nullptr);
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int status = ::pclose(p);
  *rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

Bytes Pattern(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + i * 7);
  return b;
}

// Where the data of a safetensors file starts: after its 8-byte header
// length and the header.
int64_t DataStart(const Bytes& file) {
  uint64_t n;
  std::memcpy(&n, file.data(), 8);
  return 8 + static_cast<int64_t>(n);
}

using Ranges = std::vector<std::pair<int64_t, int64_t>>;

const nlohmann::json& TensorNamed(const nlohmann::json& j, const std::string& name) {
  for (const nlohmann::json& t : j["tensors"]) {
    if (t["name"] == name) return t;
  }
  FAIL("no tensor " << name << " in " << j.dump());
  return j;
}

Ranges RangesOf(const nlohmann::json& t, int rank) {
  Ranges out;
  for (const nlohmann::json& r : t["ranks"][rank]["byte_ranges"]) {
    out.emplace_back(r[0].get<int64_t>(), r[1].get<int64_t>());
  }
  return out;
}

TEST_CASE("ferry_load --explain --json on a sharded safetensors index: each "
          "rank's absolute byte ranges in the shard that holds the tensor") {
  const std::string dir = TempDir();
  // Shard 1: q_proj BF16 [8, 16] then the norm F32 [16]; shard 2: o_proj
  // BF16 [16, 8].
  const Bytes shard1 = BuildSafetensors(
      {{"model.layers.0.self_attn.q_proj.weight", "BF16", {8, 16}, Pattern(256, 1)},
       {"model.norm.weight", "F32", {16}, Pattern(64, 2)}});
  const Bytes shard2 = BuildSafetensors(
      {{"model.layers.0.self_attn.o_proj.weight", "BF16", {16, 8}, Pattern(256, 3)}});
  WriteFile(dir + "/model-00001-of-00002.safetensors", shard1);
  WriteFile(dir + "/model-00002-of-00002.safetensors", shard2);
  WriteFile(dir + "/model.safetensors.index.json",
            std::string(R"({"metadata": {"total_size": 576}, "weight_map": {
              "model.layers.0.self_attn.q_proj.weight": "model-00001-of-00002.safetensors",
              "model.norm.weight": "model-00001-of-00002.safetensors",
              "model.layers.0.self_attn.o_proj.weight": "model-00002-of-00002.safetensors"}})"));
  const std::string index = dir + "/model.safetensors.index.json";

  int rc = 0;
  const std::string out =
      Run("--file=" + index + " --engine=tp=2 --explain --json", &rc);
  REQUIRE(rc == 0);
  const nlohmann::json j = nlohmann::json::parse(out);
  CHECK(j["tp"] == 2);
  CHECK(j["file"] == index);
  REQUIRE(j["tensors"].size() == 3);

  // q_proj: column-parallel, 4 whole rows (4 x 16 x 2 bytes) each, one
  // range, in shard 1 after its header.
  const int64_t s1 = DataStart(shard1), s2 = DataStart(shard2);
  const nlohmann::json& q = TensorNamed(j, "model.layers.0.self_attn.q_proj.weight");
  CHECK(q["split"] == "outer");
  CHECK(q["type"] == "BF16");
  CHECK(q["data_file"] == dir + "/model-00001-of-00002.safetensors");
  // The writer puts tensors in the order given, so q_proj's data is first.
  CHECK(RangesOf(q, 0) == Ranges{{s1, s1 + 128}});
  CHECK(RangesOf(q, 1) == Ranges{{s1 + 128, s1 + 256}});
  // The norm: replicated, the whole tensor after q_proj's 256 bytes.
  const nlohmann::json& norm = TensorNamed(j, "model.norm.weight");
  CHECK(norm["split"] == "replicated");
  CHECK(RangesOf(norm, 0) == Ranges{{s1 + 256, s1 + 320}});
  CHECK(RangesOf(norm, 1) == Ranges{{s1 + 256, s1 + 320}});
  // o_proj: row-parallel, in shard 2: each of 16 rows gives rank r its
  // 4 columns (8 bytes) at r * 8.
  const nlohmann::json& o = TensorNamed(j, "model.layers.0.self_attn.o_proj.weight");
  CHECK(o["split"] == "inner");
  CHECK(o["data_file"] == dir + "/model-00002-of-00002.safetensors");
  for (int r = 0; r < 2; ++r) {
    Ranges want;
    for (int row = 0; row < 16; ++row) {
      want.emplace_back(s2 + row * 16 + r * 8, s2 + row * 16 + r * 8 + 8);
    }
    CHECK(RangesOf(o, r) == want);
  }

  // The text form names the same, for a person.
  const std::string text = Run("--file=" + index + " --engine=tp=2 --explain", &rc);
  REQUIRE(rc == 0);
  CHECK(text.find("at tp 2: 3 tensors") != std::string::npos);
  CHECK(text.find("model.layers.0.self_attn.o_proj.weight") != std::string::npos);
  CHECK(text.find("rank 1: 128 bytes in 16 ranges") != std::string::npos);
  CHECK(text.find("in " + dir + "/model-00002-of-00002.safetensors") != std::string::npos);
}

TEST_CASE("ferry_load --explain --json on a quantized GGUF file: Hugging Face "
          "names, ggml types, a block-aligned inner split and a fallback") {
  GgufWriter w;
  w.String("general.architecture", "llama");
  std::vector<float> values(8 * 512);
  for (size_t i = 0; i < values.size(); ++i) values[i] = 0.001f * (i % 997) - 0.4f;
  // attn_output Q6_K [8, 512]: 2 blocks per row; TP 2 one block each.
  // ffn_down Q4_K [8, 256]: 1 block per row; TP 2 would cut it.
  const Bytes o = QuantizeQ6_K(values);
  const Bytes down = QuantizeQ4_K(std::vector<float>(values.begin(), values.begin() + 8 * 256));
  w.Tensor("blk.0.attn_output.weight", 14, {512, 8}, o);
  w.Tensor("blk.0.ffn_down.weight", 12, {256, 8}, down);
  const std::string path = TempDir() + "/m.gguf";
  const Bytes file = w.Build();
  WriteFile(path, file);
  // The writer lays the data section out at the end, tensors in order,
  // each aligned to 32: find attn_output's data by its bytes.
  const auto at = std::search(file.begin(), file.end(), o.begin(), o.end());
  REQUIRE(at != file.end());
  const int64_t base = at - file.begin();

  int rc = 0;
  const nlohmann::json j = nlohmann::json::parse(
      Run("--file=" + path + " --engine=tp=2 --explain --json", &rc));
  REQUIRE(rc == 0);
  const nlohmann::json& t = TensorNamed(j, "model.layers.0.self_attn.o_proj.weight");
  CHECK(t["file_name"] == "blk.0.attn_output.weight");
  CHECK(t["type"] == "Q6_K");
  CHECK(t["split"] == "inner");
  for (int r = 0; r < 2; ++r) {
    Ranges want;
    for (int row = 0; row < 8; ++row) {
      want.emplace_back(base + row * 420 + r * 210, base + row * 420 + r * 210 + 210);
    }
    CHECK(RangesOf(t, r) == want);
  }
  const nlohmann::json& d = TensorNamed(j, "model.layers.0.mlp.down_proj.weight");
  CHECK(d["type"] == "Q4_K");
  CHECK(d["split"] == "fallback");
  CHECK(d["reason"] == "a split at column 128 falls inside a Q4_K block of 256 elements");
  CHECK(d["ranks"].empty());

  // A file that is not a checkpoint: exit non-zero, nothing on stdout.
  const std::string bad_path = TempDir() + "/bad.gguf";
  WriteFile(bad_path, std::string("GGUF\x03\0\0\0", 8));
  const std::string bad = Run("--file=" + bad_path + " --engine=tp=2 --explain", &rc);
  CHECK(rc != 0);
  CHECK(bad.empty());
}

}  // namespace
}  // namespace testing
}  // namespace ferry
