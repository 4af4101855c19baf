// DeltaShadows (daemon/transfer/delta_shadows.h): the diff against a
// plain chunk-by-chunk comparison, and the shadows' versions: first sight
// gives nothing to patch from, a later version the changes since the one
// before, the same version the same bits, a stream that starts over
// nothing; the budget is kept by dropping the least recently used.
#include <catch2/catch.hpp>

#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "daemon/transfer/delta_shadows.h"

namespace ferry {
namespace {

TEST_CASE("shadows: the diff finds exactly the 2-byte chunks that differ, "
          "and the shadow takes the new bytes") {
  std::mt19937_64 rng(5);
  for (int64_t n : {0, 2, 6, 8, 14, 64, 1000, 4096 + 6}) {
    for (double density : {0.0, 0.01, 0.3, 1.0}) {
      std::vector<uint8_t> now(n), shadow(n);
      for (auto& b : now) b = static_cast<uint8_t>(rng());
      shadow = now;
      for (int64_t c = 0; c < n / 2; ++c) {
        if (std::uniform_real_distribution<double>(0, 1)(rng) < density) {
          shadow[2 * c + rng() % 2] ^= 1 + rng() % 255;
        }
      }
      const std::vector<uint8_t> before = shadow;
      std::vector<uint64_t> bits((n / 2 + 63) / 64 + 1, ~uint64_t{0});
      DiffIntoShadow(now.data(), shadow.data(), n, bits.data());
      INFO("n " << n << " density " << density);
      for (int64_t c = 0; c < n / 2; ++c) {
        const bool differs = std::memcmp(&now[2 * c], &before[2 * c], 2) != 0;
        CHECK(((bits[c / 64] >> (c % 64)) & 1) == (differs ? 1u : 0u));
      }
      CHECK(shadow == now);
    }
  }
}

TEST_CASE("shadows: versions, and nothing to patch from where it is not "
          "exact") {
  std::vector<int64_t> sizes = {64};
  std::unique_ptr<MemoryMap> map = MemoryMap::OwnedHost(sizes);
  uint8_t* buffer = map->base(0);
  for (int i = 0; i < 64; ++i) buffer[i] = static_cast<uint8_t>(i);
  DeltaShadows shadows(1 << 20);
  DeltaShadows::Changes c = shadows.For(map.get(), 0, 5);
  CHECK(c.since == 0);  // first sight
  buffer[10] ^= 1;      // chunk 5
  c = shadows.For(map.get(), 0, 6);
  REQUIRE(c.since == 5);
  REQUIRE(c.bits != nullptr);
  CHECK((*c.bits)[0] == uint64_t{1} << 5);
  // Another route in the same version: the same bits.
  DeltaShadows::Changes again = shadows.For(map.get(), 0, 6);
  CHECK(again.since == 5);
  CHECK(again.bits == c.bits);
  // Skipping a version: the changes since the last one read.
  buffer[20] ^= 1;  // chunk 10
  c = shadows.For(map.get(), 0, 9);
  CHECK(c.since == 6);
  CHECK((*c.bits)[0] == uint64_t{1} << 10);
  // A version that is not after the shadow's (the stream started over).
  CHECK(shadows.For(map.get(), 0, 3).since == 0);
  // Off, GPU-less but unmapped or out of range: nothing.
  DeltaShadows off(0);
  CHECK(off.For(map.get(), 0, 10).since == 0);
  CHECK(shadows.For(map.get(), 1, 10).since == 0);
  CHECK(shadows.For(nullptr, 0, 10).since == 0);
}

TEST_CASE("shadows: the budget holds, the least recently used go first") {
  std::vector<int64_t> sizes = {1000, 1000, 1000};
  std::unique_ptr<MemoryMap> map = MemoryMap::OwnedHost(sizes);
  // Room for two shadows of 1000 bytes (each costs 1000 + 1000/16 + 8).
  DeltaShadows shadows(2200);
  shadows.For(map.get(), 0, 1);
  shadows.For(map.get(), 1, 1);
  CHECK(shadows.used_bytes() <= 2200);
  shadows.For(map.get(), 0, 2);  // 0 used again: 1 is the oldest
  shadows.For(map.get(), 2, 2);  // 1 goes
  CHECK(shadows.used_bytes() <= 2200);
  CHECK(shadows.For(map.get(), 0, 3).since == 2);  // kept
  CHECK(shadows.For(map.get(), 1, 3).since == 0);  // dropped: first sight
  // A buffer larger than the whole budget is never shadowed.
  std::unique_ptr<MemoryMap> big = MemoryMap::OwnedHost({4000});
  shadows.For(big.get(), 0, 1);
  CHECK(shadows.For(big.get(), 0, 2).since == 0);
}

}  // namespace
}  // namespace ferry

namespace ferry {
namespace {

TEST_CASE("shadows: a buffer of several slices (diffed on several threads) "
          "gets the same bits") {
  const int64_t n = (int64_t{40} << 20) + 6;
  std::unique_ptr<MemoryMap> map = MemoryMap::OwnedHost({n});
  uint8_t* buffer = map->base(0);
  DeltaShadows shadows(int64_t{64} << 20);
  REQUIRE(shadows.For(map.get(), 0, 1).since == 0);
  const std::vector<int64_t> changed = {0, (int64_t{16} << 20) - 2,
                                        int64_t{16} << 20,
                                        (int64_t{32} << 20) + 126, n - 2};
  for (int64_t at : changed) buffer[at + 1] ^= 0x40;
  const DeltaShadows::Changes c = shadows.For(map.get(), 0, 2);
  REQUIRE(c.since == 1);
  int64_t set = 0;
  for (uint64_t w : *c.bits) set += __builtin_popcountll(w);
  CHECK(set == static_cast<int64_t>(changed.size()));
  for (int64_t at : changed) {
    const int64_t chunk = at / 2;
    INFO("byte " << at);
    CHECK((((*c.bits)[chunk / 64] >> (chunk % 64)) & 1) == 1u);
  }
}

}  // namespace
}  // namespace ferry
