#include "transport/tcp/tcp_channel.h"

#include <sys/socket.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "transport/bucket_segments.h"
#include "transport/byte_buffer.h"
#include "transport/memory_fault_guard.h"
#include "transport/tcp/bucket_payload.h"
#include "transport/tcp/wire_format.h"

namespace ferry {
namespace {

// Receives below this size are batched through staging even when the
// destination is contiguous, and sends below it are packed even when the
// source is: one system call per tiny box would cost more than the copy.
constexpr int64_t kDirectMinBytes = 64 << 10;

// Payload bytes handed to the kernel per sendmsg: each piece is checksummed
// (or packed and checksummed) just before, and the kernel's copy should find
// it still in the core's L2 cache (1 MiB per core here).
constexpr int64_t kSendBatchBytes = 512 << 10;

// Pieces per sendmsg, at most (well under IOV_MAX).
constexpr size_t kSendBatchPieces = 64;

class TcpChannel final : public Channel {
 public:
  TcpChannel(ScopedFd fd, std::string peer, const TcpChannelOptions& options)
      : fd_(std::move(fd)), peer_(std::move(peer)), options_(options) {}

  ~TcpChannel() override {
    // Bytes already handed to the kernel are still delivered before the FIN.
    ::shutdown(fd_.get(), SHUT_RDWR);
  }

  // Writes the header, then the payload in batches of pieces, each piece
  // checksummed right before it goes: straight from the source where a
  // segment is contiguous there and large, else packed into a cache-sized
  // scratch buffer; then the trailer. Returns once the kernel holds every
  // byte, so the source may change on return without a copy of the bucket.
  absl::Status Send(const BucketView& bucket, absl::Time deadline) override {
    if (!send_status_.ok()) return send_status_;
    if (absl::Status s = ValidateBucketView(bucket); !s.ok()) return s;
    const std::string what =
        absl::StrCat("tcp channel to ", peer_, ", bucket ", bucket.id);
    const std::vector<PackedSegment> segments =
        SplitIntoSegments(bucket, options_.segment_bytes);
    int64_t largest = kSendBatchBytes;
    for (const PackedSegment& seg : segments) {
      largest = std::max(largest, seg.bytes);
    }
    if (absl::Status s = scratch_.Reserve(largest, what); !s.ok()) return s;

    BucketHeader header;
    header.bucket_id = bucket.id;
    header.payload_bytes = static_cast<uint64_t>(bucket.bytes);
    EncodeBucketHeader(header, header_out_);
    SendBatch batch;
    batch.Add(header_out_, kBucketHeaderBytes);
    PayloadChecksum checksum;
    bool wrote = false;  // some byte of this bucket reached the kernel
    auto write = [&]() -> absl::Status {
      if (batch.pieces.empty()) return absl::OkStatus();
      wrote = true;
      absl::Status s = WriteFull(fd_.get(), batch.pieces.data(),
                                 static_cast<int>(batch.pieces.size()),
                                 deadline, what);
      batch.Clear();
      return s;
    };
    // A failure before the first write leaves the stream in step; after
    // it, the receiver can no longer find the next header.
    auto fail = [&](absl::Status s) -> absl::Status {
      if (!wrote) return s;
      send_status_ = absl::Status(
          s.code(), absl::StrCat(s.message(), "; the channel is broken"));
      return send_status_;
    };

    for (const PackedSegment& seg : segments) {
      uint8_t* direct =
          seg.bytes >= kDirectMinBytes ? ContiguousSpan(bucket, seg) : nullptr;
      const size_t n = static_cast<size_t>(seg.bytes);
      if (direct == nullptr &&
          batch.scratch_used + seg.bytes > scratch_.capacity) {
        if (absl::Status s = write(); !s.ok()) return fail(s);
      }
      // Guarded: the source belongs to a client that may shrink it; the
      // checksum touches every page just before the kernel reads it.
      absl::Status s = RunGuarded([&] {
        if (direct != nullptr) {
          checksum.Update(direct, n);
          batch.Add(direct, n);
        } else {
          uint8_t* out = scratch_.data.get() + batch.scratch_used;
          PackSegment(bucket, seg, out);
          checksum.Update(out, n);
          batch.Add(out, n);
          batch.scratch_used += seg.bytes;
        }
      });
      if (!s.ok()) return fail(s);
      if (batch.payload_bytes >= kSendBatchBytes ||
          batch.pieces.size() >= kSendBatchPieces) {
        if (absl::Status w = write(); !w.ok()) return fail(w);
      }
    }
    EncodeBucketTrailer(checksum.Finish(), trailer_out_);
    batch.Add(trailer_out_, kBucketTrailerBytes);
    if (absl::Status s = write(); !s.ok()) return fail(s);
    return absl::OkStatus();
  }

  // Send returns once the kernel holds the bucket: nothing waits here.
  absl::Status Flush(absl::Time deadline) override { return send_status_; }

  absl::Status Receive(const BucketView& bucket, absl::Time deadline) override {
    if (!receive_status_.ok()) return receive_status_;
    if (absl::Status s = ValidateBucketView(bucket); !s.ok()) return s;
    const std::string what =
        absl::StrCat("tcp channel from ", peer_, ", bucket ", bucket.id);
    // The header is resumable: a deadline that expires part-way keeps the
    // bytes read so far for the next call, so it never breaks the channel.
    size_t got = 0;
    absl::Status s =
        ReadFull(fd_.get(), header_ + header_have_,
                 kBucketHeaderBytes - header_have_, deadline,
                 absl::StrCat(what, " header"), &got);
    header_have_ += got;
    if (absl::IsDeadlineExceeded(s)) return s;
    if (!s.ok()) return Break(s);
    header_have_ = 0;
    absl::StatusOr<BucketHeader> header = ExpectBucketHeader(
        header_, bucket, absl::StrCat("tcp channel from ", peer_), what);
    if (!header.ok()) return Break(header.status());
    // From here on a failure leaves part of the bucket unread.
    s = ReceivePayload(bucket, deadline, what);
    if (!s.ok()) return Break(s);
    return absl::OkStatus();
  }

 private:
  // The pieces of one sendmsg: header, payload spans, trailer.
  struct SendBatch {
    std::vector<struct iovec> pieces;
    int64_t payload_bytes = 0;
    int64_t scratch_used = 0;

    void Add(uint8_t* data, size_t n) {
      if (n == 0) return;
      // A span that continues the previous one (packed segments in
      // scratch, consecutive rows of a box) extends it.
      if (!pieces.empty()) {
        struct iovec& last = pieces.back();
        if (static_cast<uint8_t*>(last.iov_base) + last.iov_len == data) {
          last.iov_len += n;
          payload_bytes += static_cast<int64_t>(n);
          return;
        }
      }
      pieces.push_back({data, n});
      payload_bytes += static_cast<int64_t>(n);
    }
    void Clear() {
      pieces.clear();
      payload_bytes = 0;
      scratch_used = 0;
    }
  };

  // Reads the payload segment by segment: straight into the destination
  // when it is contiguous there and large, else a batch of segments into
  // staging and then unpacked. Checksummed as it arrives, and compared with
  // the trailer.
  absl::Status ReceivePayload(const BucketView& bucket, absl::Time deadline,
                              const std::string& what) {
    const std::vector<PackedSegment> segments =
        SplitIntoSegments(bucket, options_.segment_bytes);
    int64_t largest = options_.segment_bytes;
    for (const PackedSegment& seg : segments) {
      largest = std::max(largest, seg.bytes);
    }
    if (absl::Status s = staging_.Reserve(largest, what); !s.ok()) return s;
    PayloadChecksum checksum;
    size_t got = 0;
    for (size_t i = 0; i < segments.size();) {
      const PackedSegment& first = segments[i];
      uint8_t* direct = first.bytes >= kDirectMinBytes
                            ? ContiguousSpan(bucket, first)
                            : nullptr;
      if (direct != nullptr) {
        absl::Status s = ReadFull(fd_.get(), direct,
                                  static_cast<size_t>(first.bytes), deadline,
                                  what, &got);
        if (!s.ok()) return s;
        // Guarded: the destination belongs to a client that may shrink it
        // (read(2) into a lost page is EFAULT; reading it back is SIGBUS).
        s = RunGuarded([&] {
          checksum.Update(direct, static_cast<size_t>(first.bytes));
        });
        if (!s.ok()) return s;
        ++i;
        continue;
      }
      // Segments [i, end) fit in staging together; a large contiguous one
      // ends the batch so that it can be read in place.
      size_t end = i + 1;
      int64_t batch = first.bytes;
      while (end < segments.size() &&
             batch + segments[end].bytes <= staging_.capacity &&
             !(segments[end].bytes >= kDirectMinBytes &&
               ContiguousSpan(bucket, segments[end]) != nullptr)) {
        batch += segments[end].bytes;
        ++end;
      }
      uint8_t* staging = staging_.data.get();
      absl::Status s = ReadFull(fd_.get(), staging, static_cast<size_t>(batch),
                                deadline, what, &got);
      if (!s.ok()) return s;
      checksum.Update(staging, static_cast<size_t>(batch));
      s = RunGuarded([&] {
        for (size_t k = i; k < end; ++k) {
          UnpackSegment(bucket, segments[k],
                        staging + (segments[k].offset - first.offset));
        }
      });
      if (!s.ok()) return s;
      i = end;
    }
    uint8_t trailer[kBucketTrailerBytes];
    absl::Status s = ReadFull(fd_.get(), trailer, sizeof(trailer), deadline,
                              absl::StrCat(what, " trailer"), &got);
    if (!s.ok()) return s;
    const uint64_t actual = checksum.Finish();
    const uint64_t expected = DecodeBucketTrailer(trailer);
    if (actual != expected) {
      return ChecksumMismatch(what, actual, expected, bucket.bytes);
    }
    return absl::OkStatus();
  }

  // Records an error that leaves the stream out of step; later calls
  // return it. Returns `s` for this call.
  absl::Status Break(absl::Status s) {
    receive_status_ = absl::Status(
        s.code(), absl::StrCat("tcp channel from ", peer_,
                               " is broken by an earlier error: ", s.message()));
    return s;
  }

  const ScopedFd fd_;
  const std::string peer_;  // "host:port", for messages
  const TcpChannelOptions options_;

  // Send side: only the owning thread touches these, so no lock.
  absl::Status send_status_;  // sticky once part of a bucket went out
  uint8_t header_out_[kBucketHeaderBytes] = {};
  uint8_t trailer_out_[kBucketTrailerBytes] = {};
  ByteBuffer scratch_;  // packed segments of strided boxes, a batch at a time

  // Receive side: only the owning thread touches these, so no lock.
  absl::Status receive_status_;  // sticky once the stream is out of step
  uint8_t header_[kBucketHeaderBytes] = {};
  size_t header_have_ = 0;  // bytes of header_ read by an earlier Receive
  ByteBuffer staging_;
};

absl::Status ValidateOptions(const TcpChannelOptions& options) {
  if (options.segment_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tcp channel segment_bytes must be positive, got ",
        options.segment_bytes));
  }
  return absl::OkStatus();
}

}  // namespace

TcpListener::TcpListener(ScopedFd fd, int port,
                         const TcpChannelOptions& options)
    : fd_(std::move(fd)), port_(port), options_(options) {}

absl::StatusOr<std::unique_ptr<TcpListener>> TcpListener::Listen(
    const std::string& host, int port, const TcpChannelOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  int bound = 0;
  absl::StatusOr<ScopedFd> fd = ListenTcp(host, port, options.socket, &bound);
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<TcpListener>(
      new TcpListener(*std::move(fd), bound, options));
}

absl::StatusOr<std::unique_ptr<ChannelListener>> ListenTcp(
    const std::string& host, int port, const TcpChannelOptions& options) {
  absl::StatusOr<std::unique_ptr<TcpListener>> l =
      TcpListener::Listen(host, port, options);
  if (!l.ok()) return l.status();
  return std::unique_ptr<ChannelListener>(*std::move(l));
}

absl::StatusOr<std::unique_ptr<Channel>> TcpListener::Accept(
    absl::Time deadline) {
  std::string peer;
  absl::StatusOr<ScopedFd> fd = AcceptTcp(fd_.get(), deadline, &peer);
  if (!fd.ok()) return fd.status();
  if (!options_.connection_token.empty()) {
    std::string got(options_.connection_token.size(), '\0');
    size_t done = 0;
    absl::Status s = ReadFull(
        fd->get(), reinterpret_cast<uint8_t*>(&got[0]), got.size(),
        std::min(deadline, absl::Now() + absl::Seconds(5)),
        absl::StrCat(peer, " connection token"), &done);
    if (!s.ok()) return s;
    if (got != options_.connection_token) {
      return absl::PermissionDeniedError(absl::StrCat(
          "connection from ", peer, " sent a wrong connection token"));
    }
  }
  return std::unique_ptr<Channel>(
      new TcpChannel(*std::move(fd), std::move(peer), options_));
}

absl::StatusOr<std::unique_ptr<Channel>> ConnectTcpChannel(
    const std::string& host, int port, absl::Time deadline,
    const TcpChannelOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  absl::StatusOr<ScopedFd> fd =
      ConnectTcp(host, port, deadline, options.socket);
  if (!fd.ok()) return fd.status();
  if (!options.connection_token.empty()) {
    std::string token = options.connection_token;
    struct iovec iov;
    iov.iov_base = &token[0];
    iov.iov_len = token.size();
    absl::Status s = WriteFull(fd->get(), &iov, 1, deadline,
                               absl::StrCat(host, ":", port, " token"));
    if (!s.ok()) return s;
  }
  return std::unique_ptr<Channel>(new TcpChannel(
      *std::move(fd), absl::StrCat(host, ":", port), options));
}

}  // namespace ferry
