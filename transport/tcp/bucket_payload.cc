#include "transport/tcp/bucket_payload.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "transport/bucket_segments.h"
#include "transport/memory_fault_guard.h"

namespace ferry {

absl::StatusOr<uint64_t> PackPayload(const BucketView& bucket,
                                     int64_t segment_bytes, uint8_t* payload) {
  PayloadChecksum checksum;
  const std::vector<PackedSegment> segments =
      SplitIntoSegments(bucket, segment_bytes);
  absl::Status s = RunGuarded([&] {
    for (const PackedSegment& segment : segments) {
      uint8_t* out = payload + segment.offset;
      PackSegment(bucket, segment, out);
      checksum.Update(out, static_cast<size_t>(segment.bytes));
    }
  });
  if (!s.ok()) return s;
  return checksum.Finish();
}

absl::StatusOr<BucketHeader> ExpectBucketHeader(
    const uint8_t in[kBucketHeaderBytes], const BucketView& bucket,
    const std::string& from, const std::string& what) {
  absl::StatusOr<BucketHeader> header = DecodeBucketHeader(in);
  if (!header.ok()) {
    return absl::DataLossError(
        absl::StrCat(what, ": ", header.status().message()));
  }
  if (header->bucket_id != bucket.id) {
    return absl::DataLossError(absl::StrCat(
        from, ": expected bucket ", bucket.id, " but bucket ",
        header->bucket_id, " arrived (the two ends disagree on the plan)"));
  }
  if (header->payload_bytes != static_cast<uint64_t>(bucket.bytes)) {
    return absl::DataLossError(absl::StrCat(
        what, ": expected ", bucket.bytes, " payload bytes but the header "
        "says ", header->payload_bytes));
  }
  return header;
}

absl::Status UnpackPayload(const BucketView& bucket, int64_t segment_bytes,
                           const uint8_t* payload, uint64_t expected,
                           const std::string& what) {
  PayloadChecksum checksum;
  const std::vector<PackedSegment> segments =
      SplitIntoSegments(bucket, segment_bytes);
  absl::Status s = RunGuarded([&] {
    for (const PackedSegment& segment : segments) {
      checksum.Update(payload + segment.offset,
                      static_cast<size_t>(segment.bytes));
      UnpackSegment(bucket, segment, payload + segment.offset);
    }
  });
  if (!s.ok()) return s;
  const uint64_t actual = checksum.Finish();
  if (actual != expected) {
    return ChecksumMismatch(what, actual, expected, bucket.bytes);
  }
  return absl::OkStatus();
}

absl::Status ChecksumMismatch(const std::string& what, uint64_t actual,
                              uint64_t expected, int64_t bytes) {
  return absl::DataLossError(absl::StrFormat(
      "%s: payload checksum 0x%016x does not match the header's 0x%016x "
      "(%d bytes)",
      what, actual, expected, bytes));
}

}  // namespace ferry
