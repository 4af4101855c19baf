#include "transport/tcp/wire_format.h"

#include <catch2/catch.hpp>

#include <cstring>
#include <random>
#include <vector>

namespace ferry {
namespace {

// The checksum as wire_format.h documents it, written out plainly, so that
// a change to the wire format is a deliberate one.
uint64_t ReferenceMix(uint64_t x) {
  x ^= x >> 33;
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 33;
  x *= 0xC4CEB9FE1A85EC53ull;
  x ^= x >> 33;
  return x;
}

uint64_t ReferenceChecksum(const std::vector<uint8_t>& data) {
  std::vector<uint8_t> padded = data;
  padded.resize((data.size() + 31) / 32 * 32, 0);
  uint64_t a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
  for (size_t i = 0; i < padded.size(); i += 32) {
    for (int lane = 0; lane < 4; ++lane) {
      uint64_t word = 0;
      for (int k = 7; k >= 0; --k) word = (word << 8) | padded[i + lane * 8 + k];
      a[lane] += word;
      b[lane] += a[lane];
    }
  }
  uint64_t h = ReferenceMix(data.size() ^ 0x9E3779B97F4A7C15ull);
  for (int lane = 0; lane < 4; ++lane) {
    h = ReferenceMix(h ^ a[lane]);
    h = ReferenceMix(h ^ b[lane]);
  }
  return h;
}

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (uint8_t& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

TEST_CASE("bucket headers and trailers round-trip, little-endian") {
  BucketHeader h;
  h.bucket_id = 0x0102030405060708ull;
  h.payload_bytes = 64ull << 20;
  uint8_t wire[kBucketHeaderBytes];
  EncodeBucketHeader(h, wire);
  CHECK(std::memcmp(wire, "FRY2", 4) == 0);
  CHECK(wire[8] == 0x08);  // id, low byte first
  absl::StatusOr<BucketHeader> back = DecodeBucketHeader(wire);
  REQUIRE(back.ok());
  CHECK(back->bucket_id == h.bucket_id);
  CHECK(back->payload_bytes == h.payload_bytes);

  uint8_t trailer[kBucketTrailerBytes];
  EncodeBucketTrailer(0xDEADBEEFCAFEF00Dull, trailer);
  CHECK(trailer[0] == 0x0D);
  CHECK(DecodeBucketTrailer(trailer) == 0xDEADBEEFCAFEF00Dull);
}

TEST_CASE("a header with a wrong magic or reserved word is DATA_LOSS") {
  uint8_t wire[kBucketHeaderBytes];
  EncodeBucketHeader(BucketHeader{}, wire);
  wire[0] ^= 1;
  absl::StatusOr<BucketHeader> bad = DecodeBucketHeader(wire);
  CHECK(absl::IsDataLoss(bad.status()));
  EncodeBucketHeader(BucketHeader{}, wire);
  wire[5] = 1;
  CHECK(absl::IsDataLoss(DecodeBucketHeader(wire).status()));
  // The format before (checksum in the header) is named, not just refused.
  EncodeBucketHeader(BucketHeader{}, wire);
  std::memcpy(wire, "FRY1", 4);
  absl::StatusOr<BucketHeader> old_format = DecodeBucketHeader(wire);
  CHECK(absl::IsDataLoss(old_format.status()));
  CHECK(old_format.status().message().find("FRY1") != std::string::npos);
}

TEST_CASE("the checksum matches the documented algorithm at every length") {
  for (size_t n = 0; n <= 200; ++n) {
    const std::vector<uint8_t> data = RandomBytes(n, static_cast<uint32_t>(n));
    INFO("length " << n);
    CHECK(ChecksumOf(data.data(), n) == ReferenceChecksum(data));
    CHECK(PortableChecksumOf(data.data(), n) == ReferenceChecksum(data));
  }
  const std::vector<uint8_t> big = RandomBytes(1 << 20, 99);
  CHECK(ChecksumOf(big.data(), big.size()) == ReferenceChecksum(big));
  // The AVX2 loop (where the CPU has it) and the portable one agree.
  CHECK(PortableChecksumOf(big.data(), big.size()) == ReferenceChecksum(big));
}

TEST_CASE("the checksum does not depend on how the payload is split") {
  const std::vector<uint8_t> data = RandomBytes(100000, 5);
  const uint64_t whole = ChecksumOf(data.data(), data.size());
  std::mt19937 rng(6);
  for (int trial = 0; trial < 50; ++trial) {
    PayloadChecksum c;
    size_t at = 0;
    while (at < data.size()) {
      const size_t n = std::min<size_t>(data.size() - at, rng() % 100 + (trial % 3 == 0 ? 0 : rng() % 5000));
      c.Update(data.data() + at, n);
      at += n;
    }
    CHECK(c.Finish() == whole);
  }
}

TEST_CASE("the checksum sees flipped bits, swapped words and length") {
  const std::vector<uint8_t> data = RandomBytes(256, 7);
  const uint64_t base = ChecksumOf(data.data(), data.size());
  for (size_t byte = 0; byte < data.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<uint8_t> flipped = data;
      flipped[byte] ^= static_cast<uint8_t>(1 << bit);
      INFO("byte " << byte << " bit " << bit);
      CHECK(ChecksumOf(flipped.data(), flipped.size()) != base);
    }
  }
  // Two 32-byte blocks swapped: same words, same lanes, different order.
  std::vector<uint8_t> swapped = data;
  std::swap_ranges(swapped.begin(), swapped.begin() + 32,
                   swapped.begin() + 64);
  CHECK(ChecksumOf(swapped.data(), swapped.size()) != base);
  // A trailing zero byte changes only the length.
  std::vector<uint8_t> longer = data;
  longer.push_back(0);
  CHECK(ChecksumOf(longer.data(), longer.size()) != base);
}

}  // namespace
}  // namespace ferry
