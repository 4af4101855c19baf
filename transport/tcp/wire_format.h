// What a tcp channel puts on the wire, and the payload checksum.
//
// Each bucket is a 24-byte header, the packed payload (boxes back to back,
// row-major; see bucket_segments.h) and an 8-byte trailer:
//
//   offset       size  field
//        0          4  magic "FRY2" (0x32595246 read little-endian)
//        4          4  reserved, 0
//        8          8  bucket id
//       16          8  payload bytes (N)
//       24          N  payload
//       24 + N      8  payload checksum (PayloadChecksum)
//
// The checksum trails the payload so that a sender can put each piece of
// the payload on the wire right after checksumming it, while it is still in
// cache, straight from the source memory where a box is contiguous there:
// a checksum in the header would need a pass over the whole payload before
// its first byte is sent. ("FRY1", the format before, had it in the
// header.)
//
// Integers are little-endian; the two ends are daemons of the same build,
// but the format does not depend on that. The receiver knows which bucket
// and how many bytes it expects, so the header only confirms them; a header
// that does not match is DATA_LOSS, and nothing in a header is trusted to
// size an allocation.
#ifndef FERRY_TRANSPORT_TCP_WIRE_FORMAT_H_
#define FERRY_TRANSPORT_TCP_WIRE_FORMAT_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"

namespace ferry {

constexpr uint32_t kBucketMagic = 0x32595246;  // "FRY2"
constexpr size_t kBucketHeaderBytes = 24;
constexpr size_t kBucketTrailerBytes = 8;

struct BucketHeader {
  uint64_t bucket_id = 0;
  uint64_t payload_bytes = 0;
};

void EncodeBucketHeader(const BucketHeader& header,
                        uint8_t out[kBucketHeaderBytes]);
// DATA_LOSS when the magic or the reserved word is wrong: the bytes are not
// a ferry bucket header (a desynchronized stream or a stranger).
absl::StatusOr<BucketHeader> DecodeBucketHeader(
    const uint8_t in[kBucketHeaderBytes]);

// The trailer: the payload's checksum.
void EncodeBucketTrailer(uint64_t checksum, uint8_t out[kBucketTrailerBytes]);
uint64_t DecodeBucketTrailer(const uint8_t in[kBucketTrailerBytes]);

// A 64-bit Fletcher-style checksum over 64-bit words, in four interleaved
// lanes (a += word; b += a) so the loop runs at memory speed, folded with
// the length at the end. Cheap enough to run on every byte (a few GB/s is
// the wire's speed; this runs at tens of GB/s on data in cache). It is
// sensitive to word order within a lane and to any corrupted word. Not
// cryptographic: it catches bugs (a stream out of step, a torn or misplaced
// segment) and the rare corruption TCP's 16-bit sum lets through, not an
// adversary.
//
// Streaming: Update may be called with any split of the payload; the result
// depends only on the concatenated bytes.
//
// Where the CPU has AVX2 the lanes' loop runs in one vector register each
// (chosen once, at the first checksum); the result is the same.
class PayloadChecksum {
 public:
  // One that always runs the portable loop (for tests of it on AVX2 hosts).
  static PayloadChecksum Portable() {
    PayloadChecksum c;
    c.portable_ = true;
    return c;
  }

  void Update(const uint8_t* data, size_t bytes);
  uint64_t Finish() const;

 private:
  void Blocks(const uint8_t* data, size_t blocks);

  uint64_t a_[4] = {0, 0, 0, 0};
  uint64_t b_[4] = {0, 0, 0, 0};
  uint64_t length_ = 0;
  uint8_t carry_[32] = {};  // bytes of an incomplete 32-byte block
  size_t carried_ = 0;
  bool portable_ = false;
};

uint64_t ChecksumOf(const uint8_t* data, size_t bytes);
// ChecksumOf with the portable loop only.
uint64_t PortableChecksumOf(const uint8_t* data, size_t bytes);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TCP_WIRE_FORMAT_H_
