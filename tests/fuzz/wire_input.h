// The input format of wire_format_fuzzer, shared with make_seeds.cc.
//
// A scenario is what a receiving daemon expects (the buckets the plan says
// will arrive, and where each box lands in its memory) plus the bytes a peer
// actually sends on the connection:
//
//   byte 0        bits 0-1: segment size choice (kSegmentBytes)
//                 bit 2:    send a wrong connection token
//   byte 1        buckets expected, 0 to 3 (taken mod 4)
//   per bucket    8 bytes bucket id (little-endian), 1 byte box count
//                 (mod 4), then per box: 1 byte unit bytes (kUnitBytes[b % 6]),
//                 1 byte rank (1 + b % 3), one byte extent per dim (mod 17),
//                 1 byte destination layout (Layout, mod 4)
//   the rest      the bytes sent after the connection token
//
// Inputs that end early expect fewer buckets; a scenario never fails to
// decode.
#ifndef FERRY_TESTS_FUZZ_WIRE_INPUT_H_
#define FERRY_TESTS_FUZZ_WIRE_INPUT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace ferry {
namespace fuzz {

constexpr int64_t kSegmentBytes[4] = {256 << 10, 64, 4096, 1};
constexpr int64_t kUnitBytes[6] = {1, 2, 4, 8, 144, 3};
constexpr char kConnectionToken[] = "fuzz-epoch-7-token";

enum class Layout : uint8_t {
  kRowMajor = 0,     // contiguous, the wire's own order
  kPadded = 1,       // row-major with a gap after every row
  kColumnMajor = 2,  // strides reversed
  kBroadcast = 3,    // every stride 0: all units land on one (overlapping)
};

struct BoxSpec {
  int64_t unit_bytes = 1;
  std::vector<int64_t> extent;
  Layout layout = Layout::kRowMajor;
};

struct BucketSpec {
  uint64_t id = 0;
  std::vector<BoxSpec> boxes;
};

struct WireScenario {
  int segment_choice = 0;
  bool wrong_token = false;
  std::vector<BucketSpec> buckets;
  std::string stream;  // after the token
};

inline WireScenario DecodeScenario(const uint8_t* data, size_t size) {
  WireScenario s;
  size_t at = 0;
  auto byte = [&](uint8_t* out) {
    if (at >= size) return false;
    *out = data[at++];
    return true;
  };
  uint8_t b = 0;
  if (!byte(&b)) return s;
  s.segment_choice = b & 3;
  s.wrong_token = (b & 4) != 0;
  uint8_t buckets = 0;
  if (!byte(&buckets)) return s;
  for (int i = 0; i < buckets % 4; ++i) {
    if (size - at < 9) break;
    BucketSpec bucket;
    for (int k = 0; k < 8; ++k) {
      bucket.id |= uint64_t{data[at + k]} << (8 * k);
    }
    at += 8;
    const int boxes = data[at++] % 4;
    bool complete = true;
    for (int j = 0; j < boxes && complete; ++j) {
      BoxSpec box;
      uint8_t unit = 0, rank = 0, layout = 0;
      complete = byte(&unit) && byte(&rank);
      if (!complete) break;
      box.unit_bytes = kUnitBytes[unit % 6];
      const int dims = 1 + rank % 3;
      for (int d = 0; d < dims && complete; ++d) {
        uint8_t e = 0;
        complete = byte(&e);
        box.extent.push_back(e % 17);
      }
      complete = complete && byte(&layout);
      if (!complete) break;
      box.layout = static_cast<Layout>(layout % 4);
      bucket.boxes.push_back(box);
    }
    if (!complete) break;
    s.buckets.push_back(bucket);
  }
  s.stream.assign(reinterpret_cast<const char*>(data) + at, size - at);
  return s;
}

inline std::string EncodeScenario(const WireScenario& s) {
  std::string out;
  out.push_back(static_cast<char>(s.segment_choice | (s.wrong_token ? 4 : 0)));
  out.push_back(static_cast<char>(s.buckets.size()));
  for (const BucketSpec& bucket : s.buckets) {
    for (int k = 0; k < 8; ++k) {
      out.push_back(static_cast<char>((bucket.id >> (8 * k)) & 0xff));
    }
    out.push_back(static_cast<char>(bucket.boxes.size()));
    for (const BoxSpec& box : bucket.boxes) {
      int unit = 0;
      while (kUnitBytes[unit] != box.unit_bytes) ++unit;
      out.push_back(static_cast<char>(unit));
      out.push_back(static_cast<char>(box.extent.size() - 1));
      for (int64_t e : box.extent) out.push_back(static_cast<char>(e));
      out.push_back(static_cast<char>(box.layout));
    }
  }
  out += s.stream;
  return out;
}

// Bytes of a box on the wire: its units, row-major, back to back.
inline int64_t WireBytes(const BoxSpec& box) {
  int64_t units = 1;
  for (int64_t e : box.extent) units *= e;
  return units * box.unit_bytes;
}

}  // namespace fuzz
}  // namespace ferry

#endif  // FERRY_TESTS_FUZZ_WIRE_INPUT_H_
