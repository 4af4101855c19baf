// The member's side of FP8 in flight (daemon/transfer/route_quantizers.h):
// a quantize order carried out over source ranks' memory, checked against
// the rule written from its definition (tests/core/fp8_oracle.h) over the
// whole tensor; once per run; its buffers dropped with its source ranks;
// and every malformed order refused with the reason, nothing written.
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "core/fp8_blocks.h"
#include "daemon/memory/memory_map.h"
#include "daemon/transfer/route_memory.h"
#include "daemon/transfer/route_quantizers.h"
#include "tests/core/fp8_oracle.h"

namespace ferry {
namespace testing {
namespace {

constexpr int64_t kRows = 96, kCols = 80;  // blocks 32 x 32: a 3 x 3 grid

// Two source ranks, each holding one half of a bf16 [96, 80] tensor split
// at row 40 (the middle block straddles them), row-major in buffer 0 after
// 64 bytes of something else.
struct Fixture {
  RouteMemory memory{RouteOptions{}};
  RouteQuantizers quantizers{&memory, nullptr};
  std::shared_ptr<const MemoryMap> rank0 =
      MemoryMap::OwnedHost({64 + 40 * kCols * 2});
  std::shared_ptr<const MemoryMap> rank1 =
      MemoryMap::OwnedHost({64 + 56 * kCols * 2});
  std::vector<uint16_t> tensor = std::vector<uint16_t>(kRows * kCols);

  Fixture() {
    memory.AddLocal("t0", rank0);
    memory.AddLocal("t1", rank1);
    Fill(1);
  }

  // Random bf16 values with outliers, zeros and negative zeros, written
  // into both ranks' memory.
  void Fill(uint32_t seed) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal(0, 1);
    for (size_t i = 0; i < tensor.size(); ++i) {
      float x = normal(rng);
      if (i % 97 == 0) x *= 1000;
      if (i % 89 == 0) x = 0;
      if (i % 83 == 0) x = -0.0f;
      tensor[i] = fp8_oracle::ToBf16Truncated(x);
    }
    std::memcpy(rank0->base(0) + 64, tensor.data(), 40 * kCols * 2);
    std::memcpy(rank1->base(0) + 64, tensor.data() + 40 * kCols,
                56 * kCols * 2);
  }

  static v1::QuantizeOrder Order(uint64_t run) {
    v1::QuantizeOrder o;
    o.set_quantizer_id("quantizer.policy.node-b");
    o.set_run(run);
    o.set_fp8_bytes(16 + kRows * kCols);
    o.set_scale_bytes(8 + 9 * 4);
    v1::QuantizeTensor* t = o.add_tensors();
    t->set_parameter("w");
    t->set_dtype(v1::DTYPE_BF16);
    t->add_shape(kRows);
    t->add_shape(kCols);
    t->set_format(v1::DTYPE_F8_E4M3);
    t->set_block_rows(32);
    t->set_block_cols(32);
    t->set_fp8_offset(16);
    t->set_scale_offset(8);
    for (int r = 0; r < 2; ++r) {
      v1::HeldBox* b = t->add_pieces();
      b->set_participant_id(r == 0 ? "t0" : "t1");
      b->set_buffer(0);
      b->set_byte_offset(64);
      b->add_offset(r == 0 ? 0 : 40);
      b->add_offset(0);
      b->add_extent(r == 0 ? 40 : 56);
      b->add_extent(kCols);
      b->add_strides(kCols);
      b->add_strides(1);
    }
    return o;
  }

  // "" or how the quantizer's buffers differ from the rule over `tensor`.
  std::string Differs() {
    std::shared_ptr<const MemoryMap> q =
        memory.LocalMemory("quantizer.policy.node-b");
    if (q == nullptr) return "no quantizer memory";
    std::vector<uint8_t> bytes(q->base(0) + 16, q->base(0) + 16 + kRows * kCols);
    std::vector<float> scales(9);
    std::memcpy(scales.data(), q->base(1) + 8, 9 * 4);
    return fp8_oracle::DifferenceFromRule(
        tensor, Fp8BlockShape{kRows, kCols, 32, 32}, DType::kF8E4M3, bytes,
        scales);
  }
};

TEST_CASE("A member quantizes an order's tensor from the pieces of two "
          "source ranks, once per run", "[daemon][fp8]") {
  Fixture f;
  REQUIRE(f.quantizers.Prepare(Fixture::Order(1)).ok());
  CHECK(f.Differs() == "");
  // Another route of the same run: the tensor is not quantized again,
  // though the trainer's memory changed meanwhile.
  const std::vector<uint16_t> first = f.tensor;
  f.Fill(2);
  REQUIRE(f.quantizers.Prepare(Fixture::Order(1)).ok());
  std::vector<uint16_t> now = f.tensor;
  f.tensor = first;
  CHECK(f.Differs() == "");
  // The next run quantizes the new values.
  f.tensor = now;
  REQUIRE(f.quantizers.Prepare(Fixture::Order(2)).ok());
  CHECK(f.Differs() == "");
}

TEST_CASE("Routes of one run that prepare at once (several instances' "
          "RunTransfers) all get the tensor quantized, once", "[daemon][fp8]") {
  Fixture f;
  for (uint64_t run = 1; run <= 3; ++run) {
    f.Fill(static_cast<uint32_t>(run));
    std::vector<absl::Status> status(4);
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; ++t) {
      threads.emplace_back([&, t] {
        status[t] = f.quantizers.Prepare(Fixture::Order(run));
      });
    }
    for (std::thread& t : threads) t.join();
    for (const absl::Status& s : status) CHECK(s.ok());
    CHECK(f.Differs() == "");
  }
}

TEST_CASE("A member's quantizer buffers go with its source ranks",
          "[daemon][fp8]") {
  Fixture f;
  REQUIRE(f.quantizers.Prepare(Fixture::Order(1)).ok());
  REQUIRE(f.memory.LocalMemory("quantizer.policy.node-b") != nullptr);
  f.memory.RemoveLocal("t1");
  CHECK(f.memory.LocalMemory("quantizer.policy.node-b") == nullptr);
  CHECK(f.memory.LocalMemory("t0") != nullptr);
  // Registered again, the rank is quantized from into new buffers.
  f.memory.AddLocal("t1", f.rank1);
  REQUIRE(f.quantizers.Prepare(Fixture::Order(1)).ok());
  CHECK(f.Differs() == "");
}

// The split order: this member holds only rank t1's part of the tensor
// (rows 40-95; another node holds rows 0-39), at byte 16 of buffer 0, and
// keeps the scales. `max_bits`: the combined grid (empty: BlockAmax's).
v1::QuantizeOrder SplitOrder(uint64_t run, const std::vector<uint32_t>& max_bits) {
  v1::QuantizeOrder o = Fixture::Order(run);
  v1::QuantizeTensor* t = o.mutable_tensors(0);
  t->mutable_pieces()->DeleteSubrange(0, 1);  // t0's is elsewhere
  v1::QuantizePart* p = t->add_parts();
  p->add_offset(40);
  p->add_offset(0);
  p->add_extent(56);
  p->add_extent(kCols);
  p->set_fp8_offset(16);
  t->set_fp8_offset(0);
  t->set_scales(true);
  std::string bits(max_bits.size() * 4, '\0');
  for (size_t k = 0; k < max_bits.size(); ++k) {
    for (int j = 0; j < 4; ++j) bits[4 * k + j] = static_cast<char>(max_bits[k] >> (8 * j));
  }
  t->set_max_bits(bits);
  return o;
}

// Each 32 x 32 block's max |x| over rows [r0, r1) of the tensor, as float
// bits, from the bf16 values (written here, not with the product's
// routine).
std::vector<uint32_t> MaxBits(const std::vector<uint16_t>& x, int64_t r0,
                              int64_t r1) {
  std::vector<uint32_t> out(9, 0);
  for (int64_t r = r0; r < r1; ++r) {
    for (int64_t c = 0; c < kCols; ++c) {
      const uint32_t bits = uint32_t{x[r * kCols + c]} << 16 & 0x7fffffffu;
      uint32_t& m = out[(r / 32) * 3 + c / 32];
      m = std::max(m, bits);
    }
  }
  return out;
}

TEST_CASE("A member's part of a split tensor: BlockAmax answers the max |x| "
          "of its part only, and with every holder's combined the part's "
          "bytes and the scales are the whole tensor's", "[daemon][fp8]") {
  Fixture f;
  absl::StatusOr<v1::BlockAmaxResponse> amax =
      f.quantizers.BlockAmax(SplitOrder(1, {}));
  INFO(amax.status());
  REQUIRE(amax.ok());
  REQUIRE(amax->max_bits_size() == 1);
  const std::vector<uint32_t> mine = MaxBits(f.tensor, 40, kRows);
  REQUIRE(amax->max_bits(0).size() == 9 * 4);
  std::vector<uint32_t> got(9);
  std::memcpy(got.data(), amax->max_bits(0).data(), 9 * 4);  // little-endian
  CHECK(got == mine);
  // Nothing written by BlockAmax.
  CHECK(f.memory.LocalMemory("quantizer.policy.node-b") == nullptr);

  // The combined grid (the other node's rows 0-39 too), then the part.
  REQUIRE(f.quantizers.Prepare(SplitOrder(1, MaxBits(f.tensor, 0, kRows))).ok());
  std::shared_ptr<const MemoryMap> q =
      f.memory.LocalMemory("quantizer.policy.node-b");
  REQUIRE(q != nullptr);
  std::vector<uint8_t> want;
  std::vector<float> want_scales;
  fp8_oracle::OracleBlocks(f.tensor, Fp8BlockShape{kRows, kCols, 32, 32},
                           fp8_oracle::kE4M3Spec, 448.0f, &want, &want_scales);
  CHECK(std::memcmp(q->base(0) + 16, want.data() + 40 * kCols, 56 * kCols) == 0);
  CHECK(std::memcmp(q->base(1) + 8, want_scales.data(), 9 * 4) == 0);
  // With this member's amaxes alone, the straddling block row (rows
  // 32-63) would come out otherwise: the combined grid is what counts.
  CHECK(MaxBits(f.tensor, 0, kRows) != mine);
}

TEST_CASE("A malformed quantize order is refused with the reason and "
          "writes nothing", "[daemon][fp8]") {
  Fixture f;
  struct Case {
    const char* what;
    void (*mutate)(v1::QuantizeOrder&);
    absl::StatusCode code;
    const char* says;
  };
  const Case cases[] = {
      {"no quantizer id", [](v1::QuantizeOrder& o) { o.clear_quantizer_id(); },
       absl::StatusCode::kInvalidArgument, "quantizer id"},
      {"buffers past the source ranks' bytes",
       [](v1::QuantizeOrder& o) { o.set_fp8_bytes(int64_t{1} << 40); },
       absl::StatusCode::kInvalidArgument, "at most the source ranks'"},
      {"a tensor past its buffer",
       [](v1::QuantizeOrder& o) { o.mutable_tensors(0)->set_fp8_offset(17); },
       absl::StatusCode::kInvalidArgument, "w: outside the quantizer's buffers"},
      {"a negative scale offset",
       [](v1::QuantizeOrder& o) { o.mutable_tensors(0)->set_scale_offset(-4); },
       absl::StatusCode::kInvalidArgument, "w: outside the quantizer's buffers"},
      {"an int tensor",
       [](v1::QuantizeOrder& o) { o.mutable_tensors(0)->set_dtype(v1::DTYPE_I32); },
       absl::StatusCode::kInvalidArgument, "w: dtype not bf16/f16/f32"},
      {"a format that is not FP8",
       [](v1::QuantizeOrder& o) { o.mutable_tensors(0)->set_format(v1::DTYPE_BF16); },
       absl::StatusCode::kInvalidArgument, "w: format not e4m3/e5m2"},
      {"a 3-D tensor",
       [](v1::QuantizeOrder& o) { o.mutable_tensors(0)->add_shape(2); },
       absl::StatusCode::kInvalidArgument, "w: not a 2-D shape"},
      {"a zero block",
       [](v1::QuantizeOrder& o) { o.mutable_tensors(0)->set_block_cols(0); },
       absl::StatusCode::kInvalidArgument, "w: block size out of range"},
      {"a tensor's name past the limit",
       [](v1::QuantizeOrder& o) {
         o.mutable_tensors(0)->set_parameter(std::string(100000, 'w'));
       },
       absl::StatusCode::kInvalidArgument, "a tensor's name of 100000 bytes"},
      {"a piece of nine dims",
       [](v1::QuantizeOrder& o) {
         for (int i = 0; i < 7; ++i) {
           o.mutable_tensors(0)->mutable_pieces(0)->add_extent(1);
         }
       },
       absl::StatusCode::kInvalidArgument, "more than 8 dims"},
      {"a rank not registered here",
       [](v1::QuantizeOrder& o) {
         o.mutable_tensors(0)->mutable_pieces(1)->set_participant_id("t9");
       },
       absl::StatusCode::kFailedPrecondition, "source rank t9 is not registered"},
      {"a piece past its rank's memory",
       [](v1::QuantizeOrder& o) {
         o.mutable_tensors(0)->mutable_pieces(1)->set_byte_offset(1 << 20);
       },
       absl::StatusCode::kInvalidArgument, "source rank t1"},
      {"pieces that overlap and leave a hole, their elements adding up to "
       "the tensor's",
       [](v1::QuantizeOrder& o) {
         o.mutable_tensors(0)->mutable_pieces(1)->set_offset(0, 20);
       },
       absl::StatusCode::kFailedPrecondition, "element [76, 0]"},
      {"pieces that leave a hole",
       [](v1::QuantizeOrder& o) {
         o.mutable_tensors(0)->mutable_pieces(1)->set_extent(0, 50);
       },
       absl::StatusCode::kFailedPrecondition, "element [90, 0]"},
      {"a part outside the tensor",
       [](v1::QuantizeOrder& o) { o = SplitOrder(1, std::vector<uint32_t>(9)); 
         o.mutable_tensors(0)->mutable_parts(0)->set_offset(0, 41); },
       absl::StatusCode::kInvalidArgument, "is not a 2-D box of the tensor"},
      {"a part past buffer 0",
       [](v1::QuantizeOrder& o) { o = SplitOrder(1, std::vector<uint32_t>(9));
         o.mutable_tensors(0)->mutable_parts(0)->set_fp8_offset(16 + 40 * kCols + 1); },
       absl::StatusCode::kInvalidArgument, "inside the quantizer's buffer 0"},
      {"combined amaxes of the wrong size",
       [](v1::QuantizeOrder& o) { o = SplitOrder(1, std::vector<uint32_t>(8)); },
       absl::StatusCode::kInvalidArgument, "max_bits of 32 bytes for a grid of 9"},
      {"a part of nine dims",
       [](v1::QuantizeOrder& o) { o = SplitOrder(1, std::vector<uint32_t>(9));
         for (int i = 0; i < 7; ++i) {
           o.mutable_tensors(0)->mutable_parts(0)->add_extent(1);
         }
       },
       absl::StatusCode::kInvalidArgument, "of 2 and 9 dims (parts are 2-D)"},
      {"more parts than pieces",
       [](v1::QuantizeOrder& o) { o = SplitOrder(1, std::vector<uint32_t>(9));
         v1::QuantizeTensor* t = o.mutable_tensors(0);
         *t->add_parts() = t->parts(0);
       },
       absl::StatusCode::kInvalidArgument, "has 2 parts and 1 pieces"},
      {"a part no piece here holds",
       [](v1::QuantizeOrder& o) { o = SplitOrder(1, std::vector<uint32_t>(9));
         o.mutable_tensors(0)->mutable_parts(0)->set_offset(0, 8); },
       absl::StatusCode::kFailedPrecondition, "its part [8:64"},
  };
  for (const Case& c : cases) {
    INFO(c.what);
    v1::QuantizeOrder o = Fixture::Order(1);
    c.mutate(o);
    absl::Status s = f.quantizers.Prepare(o);
    INFO(s.message());
    CHECK(s.code() == c.code);
    CHECK_THAT(std::string(s.message()), Catch::Contains(c.says));
    CHECK(f.memory.LocalMemory("quantizer.policy.node-b") == nullptr);
  }
  // BlockAmax takes split tensors only.
  absl::StatusOr<v1::BlockAmaxResponse> r =
      f.quantizers.BlockAmax(Fixture::Order(1));
  CHECK(r.status().code() == absl::StatusCode::kInvalidArgument);
  CHECK_THAT(std::string(r.status().message()),
             Catch::Contains("a tensor without parts"));
}

}  // namespace
}  // namespace testing
}  // namespace ferry
