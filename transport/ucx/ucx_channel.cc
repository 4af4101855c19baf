#include "transport/ucx/ucx_channel.h"

#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/bucket_segments.h"
#include "transport/byte_buffer.h"
#include "transport/tcp/bucket_payload.h"
#include "transport/tcp/wire_format.h"
#include "transport/ucx/ucx_worker.h"

namespace ferry {
namespace {

// Every bucket travels under this tag, matched exactly: UCP matches the
// messages of one endpoint in the order they were sent, so the receiver
// takes buckets in order and checks each one's id in its header.
constexpr ucp_tag_t kBucketTag = 0x46525932'00000001ull;  // "FRY2", 1
constexpr ucp_tag_t kFullMask = ~ucp_tag_t{0};

constexpr int kStagingBuffers = 2;
// A worker address is a few hundred bytes.
constexpr size_t kMaxAddressBytes = 64 << 10;
// How long a receiver keeps looking for a message after its peer's meeting
// connection closed (a bucket sent just before the close may still be in
// UCX's transport).
constexpr absl::Duration kPeerGoneGrace = absl::Milliseconds(200);
// How long closing an endpoint may wait for its outstanding operations.
constexpr absl::Duration kCloseWait = absl::Seconds(1);

// Completion of one UCP request, set by its callback during progress.
struct Completion {
  bool done = false;
  ucs_status_t status = UCS_OK;
};

void OnSent(void*, ucs_status_t status, void* user_data) {
  auto* c = static_cast<Completion*>(user_data);
  c->status = status;
  c->done = true;
}

void OnReceived(void*, ucs_status_t status, const ucp_tag_recv_info_t*,
                void* user_data) {
  auto* c = static_cast<Completion*>(user_data);
  c->status = status;
  c->done = true;
}

// A request whose callback marks `done`: for sends and flushes...
ucp_request_param_t SendParam(Completion* done) {
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.send = &OnSent;
  param.user_data = done;
  return param;
}

// ... and for receives.
ucp_request_param_t ReceiveParam(Completion* done) {
  ucp_request_param_t param = {};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  param.cb.recv = &OnReceived;
  param.user_data = done;
  return param;
}

void OnEndpointError(void* arg, ucp_ep_h, ucs_status_t status) {
  static_cast<std::atomic<int>*>(arg)->store(status);
}

// A packed bucket: header and payload back to back, one message.
struct StagedBucket {
  ByteBuffer message;
  int64_t bytes = 0;  // header + payload
  uint64_t id = 0;
  absl::Time deadline;
};

// OK while the meeting connection is open and silent; UNAVAILABLE once the
// peer closed it.
absl::Status MeetingConnectionState(int fd, const std::string& peer) {
  uint8_t byte;
  const ssize_t n = ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (n == 0) {
    return absl::UnavailableError(
        absl::StrCat("ucx channel peer ", peer, " closed the channel"));
  }
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
    return absl::OkStatus();
  }
  if (n < 0) {
    return absl::UnavailableError(absl::StrCat(
        "ucx channel peer ", peer, ": meeting connection failed: errno ",
        errno));
  }
  return absl::DataLossError(absl::StrCat(
      "ucx channel peer ", peer, " wrote on the meeting connection after "
      "the handshake"));
}

class UcxChannel final : public Channel {
 public:
  // The connecting end sends, the accepting end receives.
  UcxChannel(ScopedFd meeting, std::string peer, UcxChannelOptions options,
             std::unique_ptr<UcxWorker> worker, bool sending_end)
      : meeting_(std::move(meeting)),
        peer_(std::move(peer)),
        options_(std::move(options)),
        worker_(std::move(worker)),
        sending_end_(sending_end) {
    absl::MutexLock lock(&mu_);
    for (int i = 0; i < kStagingBuffers; ++i) {
      free_.push_back(std::make_unique<StagedBucket>());
    }
  }

  // The sending end, before the channel is used: its endpoint to the
  // receiving end's worker.
  absl::Status CreateEndpoint(const std::string& peer_address) {
    ucp_ep_params_t params = {};
    params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS |
                        UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                        UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
    // PEER: a failed peer fails this endpoint's operations instead of
    // aborting the process.
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = &OnEndpointError;
    params.err_handler.arg = &endpoint_error_;
    ucs_status_t st = ucp_ep_create(worker_->get(), &params, &ep_);
    if (st == UCS_ERR_UNREACHABLE) {
      // UCX 1.13's shared-memory transports cannot report a failed peer,
      // so with PEER they reach nothing. Without it they work, and a peer
      // that dies is still seen: its meeting connection closes.
      params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
      st = ucp_ep_create(worker_->get(), &params, &ep_);
    }
    return UcsStatus(st, absl::StrCat("ucx channel to ", peer_,
                                      ": ucp_ep_create"));
  }

  ~UcxChannel() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    stop_.store(true);
    if (sender_.joinable()) sender_.join();
    CloseEndpoint();
  }

  absl::Status Send(const BucketView& bucket, absl::Time deadline) override {
    if (!sending_end_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ucx channel from ", peer_, ": the accepting end receives"));
    }
    if (absl::Status s = ValidateBucketView(bucket); !s.ok()) return s;
    std::unique_ptr<StagedBucket> staged;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        return !free_.empty() || !send_status_.ok();
      };
      if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
        return absl::DeadlineExceededError(absl::StrCat(
            "ucx channel to ", peer_, ": no free staging for bucket ",
            bucket.id, " before the deadline (earlier buckets are still in "
            "flight)"));
      }
      if (!send_status_.ok()) return send_status_;
      staged = std::move(free_.back());
      free_.pop_back();
    }
    const int64_t total = static_cast<int64_t>(kBucketHeaderBytes) +
                          bucket.bytes +
                          static_cast<int64_t>(kBucketTrailerBytes);
    absl::Status s =
        staged->message.Reserve(total, absl::StrCat("ucx channel to ", peer_));
    absl::StatusOr<uint64_t> checksum;
    if (s.ok()) {
      checksum = PackPayload(bucket, options_.segment_bytes,
                             staged->message.data.get() + kBucketHeaderBytes);
      s = checksum.status();
    }
    if (!s.ok()) {  // nothing of this bucket was sent: still in step
      absl::MutexLock lock(&mu_);
      free_.push_back(std::move(staged));
      return s;
    }
    BucketHeader header;
    header.bucket_id = bucket.id;
    header.payload_bytes = static_cast<uint64_t>(bucket.bytes);
    EncodeBucketHeader(header, staged->message.data.get());
    EncodeBucketTrailer(*checksum, staged->message.data.get() +
                                       kBucketHeaderBytes + bucket.bytes);
    staged->bytes = total;
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
      return (queued_.empty() && !sending_) || !send_status_.ok();
    };
    if (!mu_.AwaitWithDeadline(absl::Condition(&idle), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          "ucx channel to ", peer_, ": ", queued_.size() + (sending_ ? 1 : 0),
          " buckets not yet delivered at the flush deadline"));
    }
    return send_status_;
  }

  absl::Status Receive(const BucketView& bucket, absl::Time deadline) override {
    if (sending_end_) {
      return absl::FailedPreconditionError(absl::StrCat(
          "ucx channel to ", peer_, ": the connecting end sends"));
    }
    if (!receive_status_.ok()) return receive_status_;
    if (absl::Status s = ValidateBucketView(bucket); !s.ok()) return s;
    const std::string what =
        absl::StrCat("ucx channel from ", peer_, ", bucket ", bucket.id);
    // The next message: looked at, not yet taken, so a deadline here
    // consumes nothing and the channel stays in step.
    ucp_tag_recv_info_t info = {};
    auto arrived = [&] {
      return ucp_tag_probe_nb(worker_->get(), kBucketTag, kFullMask,
                              /*remove=*/0, &info) != nullptr;
    };
    absl::Time gone_since = absl::InfiniteFuture();
    absl::Status s = worker_->WaitUntil(
        arrived, deadline, meeting_.get(), [&]() -> absl::Status {
          absl::Status state = MeetingConnectionState(meeting_.get(), peer_);
          if (!absl::IsUnavailable(state)) return state;
          // Closed: a last bucket may still be on its way through UCX.
          if (gone_since == absl::InfiniteFuture()) gone_since = absl::Now();
          return absl::Now() - gone_since < kPeerGoneGrace ? absl::OkStatus()
                                                           : state;
        });
    if (absl::IsDeadlineExceeded(s)) {
      return absl::DeadlineExceededError(
          absl::StrCat(what, ": nothing arrived before the deadline"));
    }
    if (!s.ok()) return Break(s);
    const uint64_t expected =
        static_cast<uint64_t>(kBucketHeaderBytes + bucket.bytes +
                              kBucketTrailerBytes);
    if (info.length != expected) {
      // Not received: its length is the peer's word, not a size to
      // allocate. The stream is out of step either way.
      return Break(absl::DataLossError(absl::StrCat(
          what, ": expected ", bucket.bytes, " payload bytes but a message "
          "of ", info.length, " bytes (header and trailer included) arrived")));
    }
    s = staging_.Reserve(static_cast<int64_t>(expected), what);
    if (!s.ok()) return Break(s);
    uint8_t* message = staging_.data.get();
    s = ReceiveMessage(message, expected, deadline, what);
    if (!s.ok()) return Break(s);
    absl::StatusOr<BucketHeader> header = ExpectBucketHeader(
        message, bucket, absl::StrCat("ucx channel from ", peer_), what);
    if (!header.ok()) return Break(header.status());
    s = UnpackPayload(bucket, options_.segment_bytes,
                      message + kBucketHeaderBytes,
                      DecodeBucketTrailer(message + kBucketHeaderBytes +
                                          bucket.bytes),
                      what);
    if (!s.ok()) return Break(s);
    return absl::OkStatus();
  }

 private:
  // Takes the next message (already probed) into `buffer`.
  absl::Status ReceiveMessage(uint8_t* buffer, uint64_t bytes,
                              absl::Time deadline, const std::string& what) {
    Completion done;
    ucp_request_param_t param = ReceiveParam(&done);
    ucs_status_ptr_t request =
        ucp_tag_recv_nbx(worker_->get(), buffer, bytes, kBucketTag,
                         kFullMask, &param);
    if (UCS_PTR_IS_ERR(request)) {
      return UcsStatus(UCS_PTR_STATUS(request), what);
    }
    if (request == nullptr) return absl::OkStatus();  // completed at once
    absl::Status s = worker_->WaitUntil(
        [&] { return done.done; }, deadline, meeting_.get(),
        [&] { return MeetingConnectionState(meeting_.get(), peer_); });
    if (!done.done) {
      // Half a bucket may have landed: cancel, and wait for the callback
      // before the buffer can be reused.
      ucp_request_cancel(worker_->get(), request);
      const absl::Time limit = absl::Now() + kCloseWait;
      while (!done.done && absl::Now() < limit) worker_->Progress();
    }
    if (!done.done) {
      // UCX still owns the request (and may write the buffer): leak both
      // rather than free them under it. The channel is broken anyway.
      staging_.data.release();
      staging_.capacity = 0;
      return absl::DataLossError(absl::StrCat(
          what, ": a receive did not finish; ", s.ToString()));
    }
    ucp_request_free(request);
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    }
    if (done.status == UCS_ERR_CANCELED) {
      // UCX cancels a receive whose sender failed part way.
      return absl::UnavailableError(absl::StrCat(
          what, ": the peer failed while the bucket was arriving"));
    }
    return UcsStatus(done.status, what);
  }

  // Runs on the sender thread: hands queued buckets to UCX in order, one
  // at a time, and progresses until each completes.
  void SenderLoop() {
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
        sending_ = true;
      }
      const absl::Status s = SendMessage(*bucket);
      absl::MutexLock lock(&mu_);
      sending_ = false;
      if (!s.ok() && send_status_.ok()) {
        // The receiver may hold part of the bucket: broken for good, and
        // the buckets queued behind it are dropped.
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

  // Progresses the send worker until `request` completes; past the
  // deadline, when the peer is gone or the channel closes, closes the
  // endpoint by force, which completes it with an error.
  absl::Status AwaitRequest(void* request, Completion& done,
                            absl::Time deadline, const std::string& what) {
    absl::Status s = worker_->WaitUntil(
        [&] { return done.done || stop_.load(); }, deadline, meeting_.get(),
        [&] { return MeetingConnectionState(meeting_.get(), peer_); });
    if (!done.done) {
      ForceClose();
      const absl::Time limit = absl::Now() + kCloseWait;
      while (!done.done && absl::Now() < limit) worker_->Progress();
    }
    // Released now, or by UCX when it completes.
    ucp_request_free(request);
    if (!done.done) {
      return absl::DataLossError(absl::StrCat(
          what, ": did not finish after its endpoint was closed; ",
          s.ToString()));
    }
    if (!s.ok()) {
      if (absl::IsDeadlineExceeded(s)) {
        return absl::DeadlineExceededError(
            absl::StrCat(what, ": not delivered before its deadline"));
      }
      return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
    }
    return UcsStatus(done.status, what);
  }

  absl::Status SendMessage(const StagedBucket& bucket) {
    const std::string what =
        absl::StrCat("ucx channel to ", peer_, ", bucket ", bucket.id);
    if (ep_ == nullptr) {
      return absl::UnavailableError(absl::StrCat(what, ": endpoint closed"));
    }
    if (const int e = endpoint_error_.load(); e != UCS_OK) {
      return UcsStatus(static_cast<ucs_status_t>(e), what);
    }
    Completion done;
    ucp_request_param_t param = SendParam(&done);
    ucs_status_ptr_t request =
        ucp_tag_send_nbx(ep_, bucket.message.data.get(),
                         static_cast<size_t>(bucket.bytes), kBucketTag, &param);
    if (UCS_PTR_IS_ERR(request)) {
      return UcsStatus(UCS_PTR_STATUS(request), what);
    }
    if (request == nullptr) {  // sent at once: in UCX's buffer, maybe
      maybe_buffered_.store(true);
      return absl::OkStatus();
    }
    absl::Status s = AwaitRequest(request, done, bucket.deadline, what);
    if (s.ok()) maybe_buffered_.store(false);
    return s;
  }

  // Closes the endpoint. A healthy one is flushed first, for a bounded
  // time, so that a bucket Flush reported handed over (a small one may
  // still sit in UCX's send buffer) reaches the peer; then it is closed by
  // force, which completes whatever is still outstanding with an error (a
  // peer that is gone cannot hold the close). Called by the sender thread,
  // or after it stopped.
  void CloseEndpoint() {
    if (ep_ == nullptr) return;
    bool healthy = endpoint_error_.load() == UCS_OK;
    {
      absl::MutexLock lock(&mu_);
      healthy = healthy && send_status_.ok();
    }
    // Only a send UCX completed at once (buffered here, eager) can be
    // short of the peer; one completed later was taken by the peer (the
    // rendezvous protocol), and the messages before it too (in order).
    // Flushing costs a round trip the peer must take part in, so it is
    // skipped when nothing can be pending.
    if (healthy && maybe_buffered_.load()) {
      Completion done;
      ucp_request_param_t param = SendParam(&done);
      ucs_status_ptr_t request = ucp_ep_flush_nbx(ep_, &param);
      if (request != nullptr && !UCS_PTR_IS_ERR(request)) {
        const absl::Time limit = absl::Now() + kCloseWait;
        while (!done.done && absl::Now() < limit) worker_->Progress();
        ForceClose();  // completes the flush if it is still waiting
        ucp_request_free(request);
        return;
      }
    }
    ForceClose();
  }

  void ForceClose() {
    if (ep_ == nullptr) return;
    ucp_request_param_t param = {};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags = UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t request = ucp_ep_close_nbx(ep_, &param);
    ep_ = nullptr;
    if (request == nullptr || UCS_PTR_IS_ERR(request)) return;
    const absl::Time limit = absl::Now() + kCloseWait;
    while (ucp_request_check_status(request) == UCS_INPROGRESS &&
           absl::Now() < limit) {
      worker_->Progress();
    }
    ucp_request_free(request);
  }

  // Out of step for good. The peer learns it from its meeting connection
  // closing: a send it is waiting on (a message this end will never take)
  // fails instead of holding its thread until the deadline.
  absl::Status Break(absl::Status s) {
    ::shutdown(meeting_.get(), SHUT_RDWR);
    receive_status_ = absl::Status(
        s.code(), absl::StrCat("ucx channel from ", peer_,
                               " is broken by an earlier error: ", s.message()));
    return s;
  }

  const ScopedFd meeting_;  // the TCP connection the ends met over
  const std::string peer_;  // "host:port", for messages
  const UcxChannelOptions options_;
  // The sending end's worker is used by its sender thread alone (and by
  // the destructor after it stopped), the receiving end's by the owner's
  // Receive. Destroyed after the endpoint (the destructor closes it).
  const std::unique_ptr<UcxWorker> worker_;
  const bool sending_end_;
  // The endpoint to the receiving end's worker: created before the sender
  // thread starts, then used by it alone (and by the destructor).
  ucp_ep_h ep_ = nullptr;
  std::atomic<int> endpoint_error_{UCS_OK};
  std::atomic<bool> stop_{false};
  // A send completed at once since the last one the peer confirmed.
  std::atomic<bool> maybe_buffered_{false};

  absl::Mutex mu_;
  std::vector<std::unique_ptr<StagedBucket>> free_ ABSL_GUARDED_BY(mu_);
  std::deque<std::unique_ptr<StagedBucket>> queued_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status send_status_ ABSL_GUARDED_BY(mu_);  // sticky
  std::thread sender_;  // started by the first Send

  // Receive side: the owning thread only.
  absl::Status receive_status_;  // sticky once out of step
  ByteBuffer staging_;
};

absl::Status ValidateOptions(const UcxChannelOptions& options) {
  if (options.segment_bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx channel segment_bytes must be positive, got ",
        options.segment_bytes));
  }
  return absl::OkStatus();
}

// A fresh worker on the shared context for its transports and devices.
absl::StatusOr<std::unique_ptr<UcxWorker>> NewWorker(
    const UcxChannelOptions& options) {
  absl::StatusOr<ucp_context_h> context =
      SharedUcpContext(options.transports, options.net_devices);
  if (!context.ok()) return context.status();
  return UcxWorker::Create(*context);
}

class UcxListenerImpl final : public UcxListener {
 public:
  UcxListenerImpl(ScopedFd fd, int port, UcxChannelOptions options,
                  std::unique_ptr<UcxWorker> worker, std::string address)
      : fd_(std::move(fd)),
        port_(port),
        options_(std::move(options)),
        worker_(std::move(worker)),
        address_(std::move(address)) {}

  int port() const override { return port_; }
  const std::string& worker_address() const override { return address_; }

  absl::StatusOr<std::unique_ptr<Channel>> Accept(
      absl::Time deadline) override {
    std::string peer;
    absl::StatusOr<ScopedFd> fd = AcceptTcp(fd_.get(), deadline, &peer);
    if (!fd.ok()) return fd.status();
    // The handshake is a few hundred bytes: a peer that stalls in it does
    // not hold the listener long.
    const absl::Time meet = std::min(deadline, absl::Now() + absl::Seconds(5));
    if (!options_.connection_token.empty()) {
      std::string got(options_.connection_token.size(), '\0');
      size_t done = 0;
      absl::Status s = ReadFull(
          fd->get(), reinterpret_cast<uint8_t*>(&got[0]), got.size(), meet,
          absl::StrCat(peer, " connection token"), &done);
      if (!s.ok()) return s;
      if (got != options_.connection_token) {
        return absl::PermissionDeniedError(absl::StrCat(
            "connection from ", peer, " sent a wrong connection token"));
      }
    }
    // The receiving end takes the worker whose address the sender was
    // given; a later Accept gets a fresh one (and a new address).
    if (worker_ == nullptr) {
      absl::StatusOr<std::unique_ptr<UcxWorker>> fresh =
          NewWorker(options_);
      if (!fresh.ok()) return fresh.status();
      absl::StatusOr<std::string> address = (*fresh)->Address();
      if (!address.ok()) return address.status();
      worker_ = *std::move(fresh);
      address_ = *std::move(address);
    }
    return std::unique_ptr<Channel>(
        new UcxChannel(*std::move(fd), std::move(peer), options_,
                       std::move(worker_), /*sending_end=*/false));
  }

 private:
  const ScopedFd fd_;
  const int port_;
  const UcxChannelOptions options_;
  std::unique_ptr<UcxWorker> worker_;  // the next accepted channel's
  std::string address_;                // its address
};

}  // namespace

absl::Status CheckUcxTransports(const std::string& transports) {
  return SharedUcpContext(transports).status();
}

absl::StatusOr<std::unique_ptr<UcxListener>> ListenUcx(
    const std::string& host, int port, const UcxChannelOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  // The worker first: a machine without the transports asked for fails
  // here, at listen time, not at the first connection.
  absl::StatusOr<std::unique_ptr<UcxWorker>> worker =
      NewWorker(options);
  if (!worker.ok()) return worker.status();
  absl::StatusOr<std::string> address = (*worker)->Address();
  if (!address.ok()) return address.status();
  int bound = 0;
  absl::StatusOr<ScopedFd> fd = ListenTcp(host, port, options.socket, &bound);
  if (!fd.ok()) return fd.status();
  return std::unique_ptr<UcxListener>(
      new UcxListenerImpl(*std::move(fd), bound, options, *std::move(worker),
                          *std::move(address)));
}

absl::StatusOr<std::unique_ptr<Channel>> ConnectUcxChannel(
    const std::string& host, int port, const std::string& worker_address,
    absl::Time deadline, const UcxChannelOptions& options) {
  if (absl::Status s = ValidateOptions(options); !s.ok()) return s;
  if (worker_address.empty() || worker_address.size() > kMaxAddressBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ucx channel to ", host, ":", port, ": a worker address of ",
        worker_address.size(), " bytes (1 to ", kMaxAddressBytes, ")"));
  }
  absl::StatusOr<ScopedFd> fd =
      ConnectTcp(host, port, deadline, options.socket);
  if (!fd.ok()) return fd.status();
  const std::string peer = absl::StrCat(host, ":", port);
  if (!options.connection_token.empty()) {
    std::string token = options.connection_token;
    struct iovec iov;
    iov.iov_base = &token[0];
    iov.iov_len = token.size();
    absl::Status s = WriteFull(fd->get(), &iov, 1, deadline,
                               absl::StrCat(peer, " token"));
    if (!s.ok()) return s;
  }
  // The endpoint needs nothing of the peer's: it may accept later (ferryd
  // asks it to once this returned).
  absl::StatusOr<std::unique_ptr<UcxWorker>> worker =
      NewWorker(options);
  if (!worker.ok()) return worker.status();
  auto channel = std::make_unique<UcxChannel>(
      *std::move(fd), peer, options, *std::move(worker), /*sending_end=*/true);
  if (absl::Status s = channel->CreateEndpoint(worker_address); !s.ok()) {
    return s;
  }
  return std::unique_ptr<Channel>(std::move(channel));
}

}  // namespace ferry
