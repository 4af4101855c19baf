// A bucket's packed form, cut into cache-sized segments.
//
// On the wire a bucket is its boxes packed back to back, each row-major and
// contiguous, in the order the BucketView lists them; sender and receiver
// derive the same byte positions from their own views, so only the payload
// travels. Both sides walk the payload segment by segment (each at most a
// few hundred KiB, cut at unit boundaries) so that a segment is packed and
// checksummed, or received, checksummed and unpacked, while it is still in
// the CPU cache.
#ifndef FERRY_TRANSPORT_BUCKET_SEGMENTS_H_
#define FERRY_TRANSPORT_BUCKET_SEGMENTS_H_

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "transport/transport.h"

namespace ferry {

// Parallel vectors of equal length, every box valid (ValidateRegionBox) and
// `bytes` equal to the boxes' sum. INVALID_ARGUMENT naming the bucket id and
// box otherwise.
absl::Status ValidateBucketView(const BucketView& bucket);

// Units [unit_begin, unit_end) of box `box`, at byte `offset` of the payload.
struct PackedSegment {
  int32_t box = 0;
  int64_t unit_begin = 0;
  int64_t unit_end = 0;
  int64_t offset = 0;
  int64_t bytes = 0;
};

// The payload in order, in segments of at most `max_bytes` (but at least one
// unit). Empty boxes yield no segment. REQUIRES: ValidateBucketView ok,
// max_bytes > 0.
std::vector<PackedSegment> SplitIntoSegments(const BucketView& bucket,
                                             int64_t max_bytes);

// Copies a segment between its box's region and `packed` (the segment's
// bytes, contiguous).
void PackSegment(const BucketView& bucket, const PackedSegment& segment,
                 uint8_t* packed);
void UnpackSegment(const BucketView& bucket, const PackedSegment& segment,
                   const uint8_t* packed);
// Where the segment's bytes live in the bucket's region when that is one
// contiguous span (the box is row-major contiguous there), so that a sender
// can write them to the socket, and a receiver read them from it, in place;
// nullptr otherwise.
uint8_t* ContiguousSpan(const BucketView& bucket, const PackedSegment& segment);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_BUCKET_SEGMENTS_H_
