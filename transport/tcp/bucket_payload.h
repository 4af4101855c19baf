// A bucket as the stream backends (tcp/, ucx/) carry it: the header, the
// boxes packed back to back (bucket_segments.h), checksummed a segment at a
// time while it is in cache, and the checksum in the trailer
// (wire_format.h). The copies run guarded (memory_fault_guard.h): the regions are
// client memory that a client may shrink.
#ifndef FERRY_TRANSPORT_TCP_BUCKET_PAYLOAD_H_
#define FERRY_TRANSPORT_TCP_BUCKET_PAYLOAD_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "transport/tcp/wire_format.h"
#include "transport/transport.h"

namespace ferry {

// Packs the bucket's source regions into `payload` (bucket.bytes) and
// returns the packed bytes' checksum; the fault guard's error when a
// source is no longer backed.
absl::StatusOr<uint64_t> PackPayload(const BucketView& bucket,
                                     int64_t segment_bytes, uint8_t* payload);

// The header of the bucket the receiver expects: DATA_LOSS, naming both
// ids, when another bucket arrived (`from` names the channel, "tcp channel
// from HOST:PORT"), or naming both sizes when its size differs (`what`
// names the bucket).
absl::StatusOr<BucketHeader> ExpectBucketHeader(
    const uint8_t in[kBucketHeaderBytes], const BucketView& bucket,
    const std::string& from, const std::string& what);

// Checksums `payload` (bucket.bytes, packed) and unpacks it into the
// bucket's destination regions; DATA_LOSS when the checksum is not
// `expected`.
absl::Status UnpackPayload(const BucketView& bucket, int64_t segment_bytes,
                           const uint8_t* payload, uint64_t expected,
                           const std::string& what);

// The DATA_LOSS of a payload whose checksum is not the header's.
absl::Status ChecksumMismatch(const std::string& what, uint64_t actual,
                              uint64_t expected, int64_t bytes);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TCP_BUCKET_PAYLOAD_H_
