// checkpoint/safetensors.h against files this test writes from the
// safetensors specification (checkpoint_writers.h): single files and a
// sharded index, tensors' bytes where the header says, and each malformed
// input refused with an error naming the file, the tensor and the byte.
#include "checkpoint/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "checkpoint/checkpoint.h"
#include "tests/checkpoint/checkpoint_writers.h"

namespace ferry {
namespace testing {
namespace {

Bytes Raw(size_t n, uint8_t seed) {
  Bytes b(n);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + 17 * i);
  return b;
}

bool Has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

std::string Error(const Bytes& bytes) {
  const std::string path = TempDir() + "/bad.safetensors";
  WriteFile(path, bytes);
  absl::StatusOr<Checkpoint> c = ReadSafetensors(path);
  REQUIRE_FALSE(c.ok());
  CHECK(c.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK(Has(std::string(c.status().message()), path));
  return std::string(c.status().message());
}

TEST_CASE("safetensors: tensors of every dtype where the header says") {
  const std::vector<SafeTensor> tensors = {
      {"model.embed_tokens.weight", "BF16", {4, 8}, Raw(64, 1)},
      {"model.norm.weight", "F32", {8}, Raw(32, 2)},
      {"scale", "F8_E4M3", {2, 2}, Raw(4, 3)},
      {"e5", "F8_E5M2", {3}, Raw(3, 4)},
      {"h", "F16", {2}, Raw(4, 5)},
      {"i8", "I8", {2}, Raw(2, 6)},
      {"u8", "U8", {2}, Raw(2, 7)},
      {"i32", "I32", {2}, Raw(8, 8)},
      {"ids", "I64", {3}, Raw(24, 9)},
      {"mask", "BOOL", {5}, Bytes{1, 0, 1, 1, 0}},
      {"empty", "F32", {0, 4}, {}},
  };
  const std::string path = TempDir() + "/model.safetensors";
  WriteFile(path, BuildSafetensors(tensors, {{"format", "pt"}}));
  absl::StatusOr<Checkpoint> c = ReadSafetensors(path);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  CHECK(c->metadata.at("format") == "pt");
  REQUIRE(c->tensors.size() == tensors.size());
  for (const SafeTensor& t : tensors) {
    INFO(t.name);
    const int32_t i = c->Find(t.name);
    REQUIRE(i >= 0);
    const CheckpointTensor& ct = c->tensors[i];
    CHECK(ct.file_type == t.dtype);
    CHECK(ct.shape == Dims(t.shape.begin(), t.shape.end()));
    CHECK(ct.bytes == static_cast<int64_t>(t.data.size()));
    if (!t.data.empty()) {
      CHECK(std::memcmp(c->Data(ct), t.data.data(), t.data.size()) == 0);
    }
  }
  CHECK(c->tensors[c->Find("model.embed_tokens.weight")].dtype == DType::kBF16);
  absl::StatusOr<Checkpoint> opened = OpenCheckpoint(path);
  REQUIRE(opened.ok());
  CHECK(opened->tensors.size() == tensors.size());
}

TEST_CASE("safetensors: malformed files are refused, named") {
  SECTION("shorter than the length") {
    CHECK(Has(Error(Bytes{1, 2, 3}), "truncated: 3 bytes"));
  }
  SECTION("a header longer than the file") {
    Bytes b = SafetensorsWithHeader("{}", {});
    b[0] = 200;
    CHECK(Has(Error(b), "the header claims 200 bytes at byte 8"));
  }
  SECTION("a header that is not JSON") {
    CHECK(Has(Error(SafetensorsWithHeader("{\"a\": [1,", {})),
              "is not a JSON object"));
  }
  SECTION("an unknown dtype") {
    CHECK(Has(Error(BuildSafetensors({{"w", "F64", {1}, Raw(8, 1)}})),
              "tensor 'w': unknown dtype 'F64'"));
  }
  SECTION("a size that does not match") {
    const std::string e = Error(SafetensorsWithHeader(
        "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,12]}}",
        Raw(12, 1)));
    CHECK(Has(e, "tensor 'w' at byte"));
    CHECK(Has(e, "12 bytes of data, but F32 [4] is 16 bytes"));
  }
  SECTION("data past the end") {
    CHECK(Has(Error(SafetensorsWithHeader(
                  "{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}",
                  Raw(8, 1))),
              "runs past the end of the file"));
  }
  SECTION("tensors sharing bytes") {
    CHECK(Has(Error(SafetensorsWithHeader(
                  "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
                  Raw(16, 1))),
              "tensors 'a' and 'b' share bytes from byte"));
  }
  SECTION("missing fields, negative sizes") {
    CHECK(Has(Error(SafetensorsWithHeader("{\"w\":{\"dtype\":\"F32\"}}", {})),
              "tensor 'w': needs"));
    CHECK(Has(Error(SafetensorsWithHeader(
                  "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,0]}}",
                  {})),
              "shape entries must be integers >= 0"));
  }
}

TEST_CASE("safetensors index: shards beside it, every tensor where it says") {
  const std::string dir = TempDir();
  WriteFile(dir + "/model-00001-of-00002.safetensors",
            BuildSafetensors({{"a", "F32", {2}, Raw(8, 1)},
                              {"b", "BF16", {2}, Raw(4, 2)}}));
  WriteFile(dir + "/model-00002-of-00002.safetensors",
            BuildSafetensors({{"c", "I64", {1}, Raw(8, 3)}}));
  const std::string index = dir + "/model.safetensors.index.json";
  WriteFile(index, std::string(
      "{\"metadata\":{\"total_size\":20},\"weight_map\":{"
      "\"a\":\"model-00001-of-00002.safetensors\","
      "\"b\":\"model-00001-of-00002.safetensors\","
      "\"c\":\"model-00002-of-00002.safetensors\"}}"));
  absl::StatusOr<Checkpoint> c = OpenCheckpoint(index);
  INFO(c.status().ToString());
  REQUIRE(c.ok());
  REQUIRE(c->files.size() == 2);
  REQUIRE(c->Find("c") >= 0);
  const CheckpointTensor& t = c->tensors[c->Find("c")];
  CHECK(c->files[t.file]->path() == dir + "/model-00002-of-00002.safetensors");
  CHECK(std::memcmp(c->Data(t), Raw(8, 3).data(), 8) == 0);

  SECTION("a missing shard") {
    WriteFile(index, std::string(
        "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
        "\"z\":\"model-00009-of-00009.safetensors\"}}"));
    absl::StatusOr<Checkpoint> bad = ReadSafetensorsIndex(index);
    REQUIRE_FALSE(bad.ok());
    CHECK(bad.status().code() == absl::StatusCode::kNotFound);
    CHECK(Has(std::string(bad.status().message()),
              "shard 'model-00009-of-00009.safetensors'"));
  }
  SECTION("a tensor not in its shard") {
    WriteFile(index, std::string(
        "{\"weight_map\":{\"c\":\"model-00001-of-00002.safetensors\"}}"));
    absl::StatusOr<Checkpoint> bad = ReadSafetensorsIndex(index);
    REQUIRE_FALSE(bad.ok());
    CHECK(Has(std::string(bad.status().message()),
              "tensor 'c' is not in its shard 'model-00001-of-00002.safetensors'"));
  }
  SECTION("a tensor in two shards") {
    WriteFile(dir + "/model-00002-of-00002.safetensors",
              BuildSafetensors({{"a", "F32", {2}, Raw(8, 3)}}));
    WriteFile(index, std::string(
        "{\"weight_map\":{\"a\":\"model-00001-of-00002.safetensors\","
        "\"c\":\"model-00002-of-00002.safetensors\"}}"));
    absl::StatusOr<Checkpoint> bad = ReadSafetensorsIndex(index);
    REQUIRE_FALSE(bad.ok());
    CHECK(Has(std::string(bad.status().message()), "tensor 'a' is in two shards"));
  }
  SECTION("not an index") {
    WriteFile(index, std::string("[1, 2]"));
    CHECK_FALSE(ReadSafetensorsIndex(index).ok());
  }
}

}  // namespace
}  // namespace testing
}  // namespace ferry
