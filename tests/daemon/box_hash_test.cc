// BoxHash and Peer.HashBoxes' side (HashMappedBoxes): a box hashes the
// same whatever its strides, and boxes are checked against their buffer.
#include <cstdint>
#include <cstring>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/transfer/box_hash.h"
#include "daemon/memory/memory_map.h"
#include "daemon/transfer/transfer_checksums.h"
#include "transport/shared_memory.h"

namespace ferry {
namespace {

TEST_CASE("a box hashes the same whatever its strides", "[verify][hash]") {
  // A [4, 6, 8] tensor of 2-byte units, row-major.
  std::vector<uint16_t> t(4 * 6 * 8);
  for (size_t i = 0; i < t.size(); ++i) t[i] = static_cast<uint16_t>(i * 7);
  const auto* base = reinterpret_cast<const uint8_t*>(t.data());
  const Dims row_major = {48, 8, 1};

  // Box [1:3, 2:5, 0:8] packed by hand, row-major.
  std::vector<uint16_t> packed;
  for (int i = 1; i < 3; ++i)
    for (int j = 2; j < 5; ++j)
      for (int k = 0; k < 8; ++k) packed.push_back(t[i * 48 + j * 8 + k]);
  const uint64_t want = HashBytes(
      reinterpret_cast<const uint8_t*>(packed.data()), packed.size() * 2);
  CHECK(HashBox(base + (1 * 48 + 2 * 8) * 2, row_major, {2, 3, 8}, 2) == want);

  // The same box stored with the dims reversed in memory (strides {1, 2, 6}).
  std::vector<uint16_t> transposed(2 * 3 * 8);
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 3; ++j)
      for (int k = 0; k < 8; ++k)
        transposed[i + 2 * j + 6 * k] = t[(i + 1) * 48 + (j + 2) * 8 + k];
  CHECK(HashBox(reinterpret_cast<const uint8_t*>(transposed.data()),
                {1, 2, 6}, {2, 3, 8}, 2) == want);

  // Unit dims and a whole contiguous tensor.
  CHECK(HashBox(base, {48, 8, 1}, {4, 6, 8}, 2) == HashBytes(base, t.size() * 2));
  CHECK(HashBox(base + 16, {999, 8, 1}, {1, 1, 8}, 2) == HashBytes(base + 16, 16));
  // Empty boxes hash as no bytes; one changed unit changes the hash.
  CHECK(HashBox(base, row_major, {0, 6, 8}, 2) == HashBytes(nullptr, 0));
  t[1 * 48 + 3 * 8 + 4] ^= 1;
  CHECK(HashBox(base + (1 * 48 + 2 * 8) * 2, row_major, {2, 3, 8}, 2) != want);
}

TEST_CASE("HashMappedBoxes hashes boxes inside registered buffers",
          "[verify][hash]") {
  auto shm = SharedMemoryRegion::Create("box-hash-test", 4096);
  REQUIRE(shm.ok());
  for (int i = 0; i < 4096; ++i) shm->data()[i] = static_cast<uint8_t>(i * 31);
  google::protobuf::RepeatedPtrField<v1::MemoryRegion> regions;
  v1::MemoryRegion* r = regions.Add();
  r->set_region_id(3);
  r->set_size_bytes(4096);
  r->mutable_shared_memory()->set_shm_name(shm->name());
  auto map = MemoryMap::Map(regions, "test rank");
  REQUIRE(map.ok());
  std::shared_ptr<const MemoryMap> memory = *std::move(map);
  auto memory_of = [&](const std::string& id) {
    return id == "p1" ? memory : nullptr;
  };

  auto box = [](int64_t offset, std::vector<int64_t> strides,
                std::vector<int64_t> extent, const char* who = "p1") {
    v1::TransferBox b;
    b.set_participant_id(who);
    b.set_buffer(0);
    b.set_byte_offset(offset);
    for (int64_t s : strides) b.add_strides(s);
    for (int64_t e : extent) b.add_extent(e);
    b.set_unit_bytes(4);
    return b;
  };
  v1::HashBoxesRequest req;
  *req.add_boxes() = box(64, {16, 1}, {4, 8});   // 4 rows of 8 floats, pitch 16
  *req.add_boxes() = box(0, {1}, {1024});        // the whole buffer
  v1::HashBoxesResponse resp;
  REQUIRE(HashMappedBoxes(req, memory_of, 2, &resp).ok());
  REQUIRE(resp.boxes_size() == 2);
  CHECK(resp.boxes(0).hash() ==
        HashBox(shm->data() + 64, {16, 1}, {4, 8}, 4));
  CHECK(resp.boxes(1).hash() == HashBytes(shm->data(), 4096));
  CHECK(resp.boxes(0).unhashable().empty());

  v1::HashBoxesRequest past;
  *past.add_boxes() = box(64, {16, 1}, {64, 1});  // last unit at byte 4096
  v1::HashBoxesResponse ignored;
  CHECK(HashMappedBoxes(past, memory_of, 1, &ignored).code() ==
        absl::StatusCode::kInvalidArgument);
  v1::HashBoxesRequest stranger;
  *stranger.add_boxes() = box(0, {1}, {4}, "p2");
  v1::HashBoxesResponse ignored2;
  CHECK(HashMappedBoxes(stranger, memory_of, 1, &ignored2).code() ==
        absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace ferry
