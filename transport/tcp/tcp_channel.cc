#include "transport/tcp/tcp_channel.h"

#include <sys/socket.h>

#include <algorithm>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/bucket_segments.h"
#include "transport/byte_buffer.h"
#include "transport/memory_fault_guard.h"
#include "transport/tcp/bucket_payload.h"
#include "transport/tcp/wire_format.h"

namespace ferry {
namespace {

// Two staging buffers: one on the wire, one being packed or waiting.
constexpr int kStagingBuffers = 2;

// Receives below this size are batched through staging even when the
// destination is contiguous: one recv per tiny box would cost more than
// the extra copy.
constexpr int64_t kDirectReadMinBytes = 64 << 10;

// A packed bucket waiting for, or on, the wire.
struct StagedBucket {
  ByteBuffer payload;
  int64_t bytes = 0;
  uint64_t id = 0;
  uint8_t header[kBucketHeaderBytes] = {};
  absl::Time deadline;
};

class TcpChannel final : public Channel {
 public:
  TcpChannel(ScopedFd fd, std::string peer, const TcpChannelOptions& options)
      : fd_(std::move(fd)), peer_(std::move(peer)), options_(options) {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < kStagingBuffers; ++i) {
      free_.push_back(std::make_unique<StagedBucket>());
    }
  }

  ~TcpChannel() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    // Wakes a sender blocked in poll() on a peer that stopped reading; data
    // already handed to the kernel is still delivered before the FIN.
    ::shutdown(fd_.get(), SHUT_RDWR);
    if (sender_.joinable()) sender_.join();
  }

  absl::Status Send(const BucketView& bucket, absl::Time deadline) override {
    if (absl::Status s = ValidateBucketView(bucket); !s.ok()) return s;
    std::unique_ptr<StagedBucket> staged;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !free_.empty() || !send_status_.ok();
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
        // Nothing of this bucket was sent: the channel is still in step.
        return absl::DeadlineExceededError(absl::StrCat(
            "tcp channel to ", peer_, ": no free staging for bucket ",
            bucket.id, " before the deadline (earlier buckets are still on "
            "the wire)"));
      }
      if (!send_status_.ok()) return send_status_;
      staged = std::move(free_.back());
      free_.pop_back();
    }
    // Packed without the lock, while the sender thread writes the other
    // buffer. Each segment is checksummed right after it is packed, while
    // it is still in cache.
    absl::Status s = staged->payload.Reserve(
        bucket.bytes, absl::StrCat("tcp channel to ", peer_));
    if (!s.ok()) {
      absl::MutexLock lock(&mu_);
      free_.push_back(std::move(staged));
      return s;
    }
    absl::StatusOr<uint64_t> checksum = PackPayload(
        bucket, options_.segment_bytes, staged->payload.data.get());
    if (!checksum.ok()) {  // nothing of this bucket was sent: still in step
      absl::MutexLock lock(&mu_);
      free_.push_back(std::move(staged));
      return checksum.status();
    }
    BucketHeader header;
    header.bucket_id = bucket.id;
    header.payload_bytes = static_cast<uint64_t>(bucket.bytes);
    header.checksum = *checksum;
    EncodeBucketHeader(header, staged->header);
    staged->bytes = bucket.bytes;
    staged->id = bucket.id;
    staged->deadline = deadline;
    {
      absl::MutexLock lock(&mu_);
      queued_.push_back(std::move(staged));
    }
    if (!sender_.joinable()) sender_ = std::thread([this] { SenderLoop(); });
    return absl::OkStatus();
  }

  absl::Status Flush(absl::Time deadline) override {
    absl::MutexLock lock(&mu_);
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return (queued_.empty() && !writing_) || !send_status_.ok();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "tcp channel to ", peer_, ": ", queued_.size() + (writing_ ? 1 : 0),
          " buckets not yet on the wire at the flush deadline"));
    }
    return send_status_;
  }

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
    // From here on a failure leaves part of the payload unread.
    s = ReceivePayload(bucket, header->checksum, deadline, what);
    if (!s.ok()) return Break(s);
    return absl::OkStatus();
  }

 private:
  // Runs on the sender thread: writes queued buckets in order.
  void SenderLoop() {
    const std::string what = absl::StrCat("tcp channel to ", peer_);
    while (true) {
      std::unique_ptr<StagedBucket> bucket;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !queued_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (stopping_) return;  // queued buckets are discarded
        bucket = std::move(queued_.front());
        queued_.pop_front();
        writing_ = true;
      }
      struct iovec iov[2] = {
          {bucket->header, kBucketHeaderBytes},
          {bucket->payload.data.get(), static_cast<size_t>(bucket->bytes)}};
      absl::Status s = WriteFull(fd_.get(), iov, 2, bucket->deadline,
                                 absl::StrCat(what, ", bucket ", bucket->id));
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (!s.ok() && send_status_.ok()) {
        // Part of a bucket may be on the wire: the receiver can no longer
        // find the next header, so the channel is broken for good and the
        // buckets queued behind this one are dropped.
        send_status_ = absl::Status(
            s.code(), absl::StrCat(s.message(), "; the channel is broken"));
        while (!queued_.empty()) {
          free_.push_back(std::move(queued_.front()));
          queued_.pop_front();
        }
      }
      free_.push_back(std::move(bucket));
    }
  }

  // Reads the payload segment by segment: straight into the destination
  // when it is contiguous there and large, else a batch of segments into
  // staging and then unpacked. Checksummed as it arrives.
  absl::Status ReceivePayload(const BucketView& bucket, uint64_t expected,
                              absl::Time deadline, const std::string& what) {
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
      uint8_t* direct = first.bytes >= kDirectReadMinBytes
                            ? ContiguousDestination(bucket, first)
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
             !(segments[end].bytes >= kDirectReadMinBytes &&
               ContiguousDestination(bucket, segments[end]) != nullptr)) {
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
    const uint64_t actual = checksum.Finish();
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

  absl::Mutex mu_;
  std::vector<std::unique_ptr<StagedBucket>> free_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<StagedBucket>> queued_ ABSL_GUARDED_BY(mu_);
  bool writing_ ABSL_GUARDED_BY(mu_) = false;  // the sender holds a bucket
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // The first write error; sticky.
  absl::Status send_status_ ABSL_GUARDED_BY(mu_);
  // Started by the first Send. Only the owning thread (Send) and the
  // destructor touch it, and they never run at once.
  std::thread sender_;

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
