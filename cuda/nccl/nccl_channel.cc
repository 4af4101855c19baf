#include "cuda/nccl/nccl_channel.h"

#include <cuda_runtime_api.h>
#include <glog/logging.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda/cuda_status.h"
#include "cuda/device.h"
#include "cuda/kernels/box_copier.h"
#include "cuda/kernels/box_copy_plan.h"
#include "transport/bucket_segments.h"

namespace ferry {
namespace {

using gpu::BoxCopier;
using gpu::BoxCopyPlan;
using gpu::CudaStatus;
using gpu::NcclCommunicator;
using gpu::NcclLoopback;

constexpr int kSlots = 2;
constexpr uint64_t kHeaderMagic = 0x314C43434E595246ull;  // "FRYNCCL1"

// The bucket header, sent before the payload. Both ends are the same
// architecture (x86-64 or aarch64, little-endian): no byte swapping.
struct WireHeader {
  uint64_t magic = kHeaderMagic;
  uint64_t id = 0;
  int64_t bytes = 0;
  int64_t chunk_bytes = 0;  // the sender's chunk limit (its staging size)
  uint64_t boxes = 0;
  uint64_t layout_digest = 0;  // extents and unit sizes, in order
  uint64_t reserved[2] = {0, 0};
};
constexpr size_t kHeaderBytes = sizeof(WireHeader);
static_assert(kHeaderBytes == 64, "the wire header is 64 bytes");

// FNV-1a over the boxes' ranks, extents and unit sizes: both ends cut the
// payload into the same chunks only when these agree.
uint64_t LayoutDigest(const BucketView& b) {
  uint64_t h = 0xcbf29ce484222325ull;
  auto mix = [&h](int64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= static_cast<uint64_t>(v >> (8 * i)) & 0xff;
      h *= 0x100000001b3ull;
    }
  };
  for (size_t i = 0; i < b.extents.size(); ++i) {
    mix(static_cast<int64_t>(b.extents[i].size()));
    for (int64_t e : b.extents[i]) mix(e);
    mix(b.unit_bytes[i]);
  }
  return h;
}

// Segments [first, last) of the payload, sent as one NCCL message.
struct Chunk {
  size_t first = 0;
  size_t last = 0;
  int64_t bytes = 0;
};

std::vector<Chunk> ChunkSegments(const std::vector<PackedSegment>& segments,
                                 int64_t limit) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < segments.size(); ++i) {
    if (chunks.empty() || chunks.back().bytes + segments[i].bytes > limit) {
      chunks.push_back(Chunk{i, i, 0});
    }
    chunks.back().last = i + 1;
    chunks.back().bytes += segments[i].bytes;
  }
  return chunks;
}

// One staging slot: `staging_bytes` of payload, then the header area.
struct Slot {
  uint8_t* data = nullptr;           // device
  WireHeader* header_host = nullptr;  // pinned
  cudaEvent_t ready = nullptr;  // sender: packed; receiver: received
  cudaEvent_t done = nullptr;   // sender: sent; receiver: unpacked
  bool done_recorded = false;
  int64_t loopback_seq = -1;  // sender, loopback: last message posted
};

class NcclChannel final : public Channel {
 public:
  NcclChannel(NcclCommunicator* comm, const NcclChannelOptions& options)
      : comm_(comm), options_(options) {}

  absl::Status Init() {
    if (absl::Status s = gpu::UseDevice(comm_->device()); !s.ok()) return s;
    for (cudaStream_t* s : {&pack_stream_, &comm_stream_, &unpack_stream_}) {
      FERRY_CUDA_RETURN_IF_ERROR(
          cudaStreamCreateWithFlags(s, cudaStreamNonBlocking));
    }
    FERRY_CUDA_RETURN_IF_ERROR(
        cudaEventCreateWithFlags(&scratch_event_, cudaEventDisableTiming));
    for (int side = 0; side < 2; ++side) {
      absl::StatusOr<std::unique_ptr<BoxCopier>> copier =
          BoxCopier::Create(comm_->device());
      if (!copier.ok()) return copier.status();
      (side == 0 ? packer_ : unpacker_) = *std::move(copier);
    }
    if (loopback()) comm_->loopback()->Attach();
    return absl::OkStatus();
  }

  ~NcclChannel() override {
    if (!gpu::UseDevice(comm_->device()).ok()) return;
    const absl::Time deadline = absl::Now() + options_.close_timeout;
    bool safe = true;
    if (loopback()) safe = comm_->loopback()->Detach(deadline);
    // Staging still read by NCCL or a kernel must not be freed: wait, then
    // abort the communicator to cancel what is stuck, then give up (leak).
    for (Slot* slots : {send_slots_, recv_slots_}) {
      for (int i = 0; i < kSlots; ++i) {
        if (!slots[i].done_recorded) continue;
        if (!gpu::PollEvent(slots[i].done, deadline, "close").ok()) {
          comm_->Abort(absl::CancelledError(
              "an NCCL channel was closed with transfers in flight"));
          safe = safe && gpu::PollEvent(slots[i].done,
                                        absl::Now() + absl::Seconds(2),
                                        "close after abort")
                             .ok();
        }
      }
    }
    if (!safe) {
      LOG(ERROR) << comm_->name() << ": channel to rank " << options_.peer
                 << " closed with transfers stuck; leaking its staging";
      return;
    }
    packer_.reset();
    unpacker_.reset();
    for (Slot* slots : {send_slots_, recv_slots_}) {
      for (int i = 0; i < kSlots; ++i) {
        if (slots[i].data != nullptr) {
          (void)cudaFreeAsync(slots[i].data, comm_stream_);
        }
        if (slots[i].header_host != nullptr) {
          (void)cudaFreeHost(slots[i].header_host);
        }
        if (slots[i].ready != nullptr) (void)cudaEventDestroy(slots[i].ready);
        if (slots[i].done != nullptr) (void)cudaEventDestroy(slots[i].done);
      }
    }
    if (scratch_event_ != nullptr) (void)cudaEventDestroy(scratch_event_);
    for (cudaStream_t s : {pack_stream_, comm_stream_, unpack_stream_}) {
      if (s != nullptr) (void)cudaStreamDestroy(s);
    }
  }

  absl::Status Send(const BucketView& bucket, absl::Time deadline) override {
    if (!broken_.ok()) return broken_;
    if (absl::Status s = CheckBucket(bucket); !s.ok()) return s;
    if (absl::Status s = gpu::UseDevice(comm_->device()); !s.ok()) return s;
    if (absl::Status s = EnsureSlots(send_slots_); !s.ok()) return s;
    const std::vector<PackedSegment> segments =
        SplitIntoSegments(bucket, options_.staging_bytes);
    const std::vector<Chunk> chunks =
        ChunkSegments(segments, options_.staging_bytes);
    // Plan every chunk before anything moves: a box the kernel cannot take
    // is INVALID_ARGUMENT with the channel intact.
    std::vector<BoxCopyPlan> plans(chunks.size());
    for (size_t c = 0; c < chunks.size(); ++c) {
      Slot& slot = send_slots_[(next_send_ + c) % kSlots];
      if (absl::Status s =
              plans[c].AddSegments(bucket, segments, chunks[c].first,
                                   chunks[c].last, slot.data, /*pack=*/true);
          !s.ok()) {
        return s;
      }
    }
    WireHeader header;
    header.id = bucket.id;
    header.bytes = bucket.bytes;
    header.chunk_bytes = options_.staging_bytes;
    header.boxes = bucket.regions.size();
    header.layout_digest = LayoutDigest(bucket);

    bool started = false;  // a message of this bucket was handed over
    const size_t messages = std::max<size_t>(1, chunks.size());
    for (size_t c = 0; c < messages; ++c) {
      Slot& slot = send_slots_[next_send_];
      next_send_ = (next_send_ + 1) % kSlots;
      absl::Status s = WaitSendSlot(slot, deadline);
      if (!s.ok()) {
        // A loopback sender that found no free staging consumed nothing.
        if (loopback() && !started && absl::IsDeadlineExceeded(s)) return s;
        return Fail(s);
      }
      uint8_t* header_dev = slot.data + options_.staging_bytes;
      if (c == 0) {
        *slot.header_host = header;
        s = CudaStatus(cudaMemcpyAsync(header_dev, slot.header_host,
                                       kHeaderBytes, cudaMemcpyHostToDevice,
                                       pack_stream_),
                       "cudaMemcpyAsync(bucket header)");
      }
      if (s.ok() && c < chunks.size()) {
        s = packer_->Launch(plans[c], pack_stream_, deadline);
      }
      if (s.ok()) {
        s = CudaStatus(cudaEventRecord(slot.ready, pack_stream_),
                       "cudaEventRecord(packed)");
      }
      if (s.ok() && !loopback()) {
        // Remote: the comm stream sends once the pack is done.
        s = CudaStatus(cudaStreamWaitEvent(comm_stream_, slot.ready, 0),
                       "cudaStreamWaitEvent(packed)");
        if (s.ok() && c == 0) {
          s = comm_->Group({{true, header_dev, kHeaderBytes, options_.peer}},
                           comm_stream_, deadline);
        }
        if (s.ok() && c < chunks.size()) {
          s = comm_->Group({{true, slot.data,
                             static_cast<size_t>(chunks[c].bytes),
                             options_.peer}},
                           comm_stream_, deadline);
        }
        if (s.ok()) {
          s = CudaStatus(cudaEventRecord(slot.done, comm_stream_),
                         "cudaEventRecord(sent)");
          slot.done_recorded = s.ok();
        }
      } else if (s.ok()) {
        // Loopback: the receiver issues the grouped send/recv; it gets the
        // buffer once it is packed.
        s = gpu::PollEvent(slot.ready, deadline, "packing a chunk");
        NcclLoopback* lb = comm_->loopback();
        absl::StatusOr<int64_t> seq = int64_t{-1};
        if (s.ok() && c == 0) {
          seq = lb->Post(header_dev, kHeaderBytes);
          s = seq.status();
        }
        if (s.ok() && c < chunks.size()) {
          seq = lb->Post(slot.data, static_cast<size_t>(chunks[c].bytes));
          s = seq.status();
        }
        if (s.ok()) slot.loopback_seq = *seq;
      }
      if (!s.ok()) return Fail(s);
      started = true;
    }
    // The source may change as soon as Send returns: the last pack (and so
    // every earlier one, on the same stream) must be done.
    const Slot& last = send_slots_[(next_send_ + kSlots - 1) % kSlots];
    absl::Status s = gpu::PollEvent(last.ready, deadline, "packing a bucket");
    return s.ok() ? s : Fail(s);
  }

  absl::Status Flush(absl::Time deadline) override {
    if (!broken_.ok()) return broken_;
    for (Slot& slot : send_slots_) {
      if (absl::Status s = WaitSendSlot(slot, deadline); !s.ok()) {
        return Fail(s);
      }
    }
    return absl::OkStatus();
  }

  absl::Status Receive(const BucketView& bucket,
                       absl::Time deadline) override {
    if (!broken_.ok()) return broken_;
    if (absl::Status s = CheckBucket(bucket); !s.ok()) return s;
    if (absl::Status s = gpu::UseDevice(comm_->device()); !s.ok()) return s;
    if (absl::Status s = EnsureSlots(recv_slots_); !s.ok()) return s;

    // The header, into slot 0's header area (never payload).
    Slot& hs = recv_slots_[0];
    uint8_t* header_dev = hs.data + options_.staging_bytes;
    bool consumed = false;
    absl::Status s =
        ReceiveMessage(header_dev, kHeaderBytes, deadline, &consumed);
    if (!s.ok()) return consumed ? Fail(s) : s;
    s = CudaStatus(cudaMemcpyAsync(hs.header_host, header_dev, kHeaderBytes,
                                   cudaMemcpyDeviceToHost, comm_stream_),
                   "cudaMemcpyAsync(bucket header)");
    if (s.ok()) s = RecordAndWait(comm_stream_, deadline, "bucket header");
    if (!s.ok()) return Fail(s);
    const WireHeader header = *hs.header_host;
    if (s = CheckHeader(header, bucket); !s.ok()) return Fail(s);

    const std::vector<PackedSegment> segments =
        SplitIntoSegments(bucket, header.chunk_bytes);
    const std::vector<Chunk> chunks =
        ChunkSegments(segments, header.chunk_bytes);
    std::vector<BoxCopyPlan> plans(chunks.size());
    for (size_t c = 0; c < chunks.size(); ++c) {
      Slot& slot = recv_slots_[(next_recv_ + c) % kSlots];
      s = plans[c].AddSegments(bucket, segments, chunks[c].first,
                               chunks[c].last, slot.data, /*pack=*/false);
      if (!s.ok()) return Fail(s);  // the sender's bytes are on their way
    }
    for (size_t c = 0; c < chunks.size(); ++c) {
      Slot& slot = recv_slots_[next_recv_];
      next_recv_ = (next_recv_ + 1) % kSlots;
      if (slot.done_recorded) {
        s = comm_->Wait(slot.done, deadline, "unpacking a chunk");
        slot.done_recorded = false;
      }
      if (s.ok()) {
        s = ReceiveMessage(slot.data, static_cast<size_t>(chunks[c].bytes),
                           deadline, &consumed);
      }
      // Received (in comm stream order) -> unpack on the unpack stream.
      if (s.ok()) {
        s = CudaStatus(cudaEventRecord(slot.ready, comm_stream_),
                       "cudaEventRecord(received)");
      }
      if (s.ok()) {
        s = CudaStatus(cudaStreamWaitEvent(unpack_stream_, slot.ready, 0),
                       "cudaStreamWaitEvent(received)");
      }
      if (s.ok()) s = unpacker_->Launch(plans[c], unpack_stream_, deadline);
      if (s.ok()) {
        s = CudaStatus(cudaEventRecord(slot.done, unpack_stream_),
                       "cudaEventRecord(unpacked)");
        slot.done_recorded = s.ok();
      }
      if (!s.ok()) return Fail(s);
    }
    for (Slot& slot : recv_slots_) {
      if (!slot.done_recorded) continue;
      s = comm_->Wait(slot.done, deadline, "unpacking a bucket");
      slot.done_recorded = false;
      if (!s.ok()) return Fail(s);
    }
    return absl::OkStatus();
  }

 private:
  bool loopback() const { return options_.peer == comm_->rank(); }

  // Breaks the channel for good: the two ends no longer agree on where the
  // next bucket starts. Remote: the communicator is aborted, so the peer's
  // waits fail too instead of hanging.
  absl::Status Fail(absl::Status s) {
    if (broken_.ok()) broken_ = s;
    if (loopback()) {
      comm_->loopback()->Break(s);
    } else {
      comm_->Abort(s);
    }
    return s;
  }

  absl::Status CheckBucket(const BucketView& bucket) const {
    if (absl::Status s = ValidateBucketView(bucket); !s.ok()) return s;
    for (size_t i = 0; i < bucket.unit_bytes.size(); ++i) {
      if (bucket.unit_bytes[i] > options_.staging_bytes) {
        return absl::InvalidArgumentError(absl::StrCat(
            "bucket ", bucket.id, " box ", i, ": a unit of ",
            bucket.unit_bytes[i], " bytes exceeds the staging slot of ",
            options_.staging_bytes));
      }
    }
    return absl::OkStatus();
  }

  absl::Status CheckHeader(const WireHeader& h,
                           const BucketView& bucket) const {
    if (h.magic != kHeaderMagic) {
      return absl::DataLossError(absl::StrCat(
          "expected the header of bucket ", bucket.id,
          "; bytes that are not a bucket header arrived"));
    }
    if (h.id != bucket.id || h.bytes != bucket.bytes ||
        h.boxes != bucket.regions.size() ||
        h.layout_digest != LayoutDigest(bucket)) {
      return absl::DataLossError(absl::StrCat(
          "expected bucket ", bucket.id, " (", bucket.bytes, " bytes, ",
          bucket.regions.size(), " boxes), but bucket ", h.id, " (", h.bytes,
          " bytes, ", h.boxes, " boxes", 
          h.layout_digest != LayoutDigest(bucket) ? ", another box layout"
                                                   : "",
          ") arrived"));
    }
    if (h.chunk_bytes <= 0 || h.chunk_bytes > options_.staging_bytes) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the sender's chunks of ", h.chunk_bytes,
          " bytes do not fit this receiver's staging of ",
          options_.staging_bytes, " bytes"));
    }
    return absl::OkStatus();
  }

  absl::Status EnsureSlots(Slot* slots) {
    for (int i = 0; i < kSlots; ++i) {
      Slot& slot = slots[i];
      if (slot.data != nullptr) continue;
      void* data = nullptr;
      // Stream-ordered allocation: freeing it later never blocks the host
      // (cudaFree would wait for the whole device).
      FERRY_CUDA_RETURN_IF_ERROR(cudaMallocAsync(
          &data, options_.staging_bytes + kHeaderBytes, comm_stream_));
      FERRY_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(comm_stream_));
      slot.data = static_cast<uint8_t*>(data);
      void* host = nullptr;
      FERRY_CUDA_RETURN_IF_ERROR(
          cudaHostAlloc(&host, kHeaderBytes, cudaHostAllocDefault));
      slot.header_host = new (host) WireHeader();
      FERRY_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&slot.ready, cudaEventDisableTiming));
      FERRY_CUDA_RETURN_IF_ERROR(
          cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming));
    }
    return absl::OkStatus();
  }

  // Sender: waits until `slot` may be packed into again.
  absl::Status WaitSendSlot(Slot& slot, absl::Time deadline) {
    if (slot.loopback_seq >= 0) {
      if (absl::Status s =
              comm_->loopback()->WaitReceived(slot.loopback_seq, deadline);
          !s.ok()) {
        return s;
      }
      slot.loopback_seq = -1;
    }
    if (slot.done_recorded) {
      if (absl::Status s = comm_->Wait(slot.done, deadline, "sending a chunk");
          !s.ok()) {
        return s;
      }
      slot.done_recorded = false;
    }
    return absl::OkStatus();
  }

  absl::Status RecordAndWait(cudaStream_t stream, absl::Time deadline,
                             absl::string_view what) {
    if (absl::Status s = CudaStatus(cudaEventRecord(scratch_event_, stream),
                                    "cudaEventRecord");
        !s.ok()) {
      return s;
    }
    return comm_->Wait(scratch_event_, deadline, what);
  }

  // Receives the next message, `bytes` long, into `dst` on the comm stream.
  // Remote: enqueued (it lands in comm stream order). Loopback: the
  // grouped self send/recv has completed. *consumed: whether the message
  // was taken from the peer (an error before it leaves the stream intact).
  absl::Status ReceiveMessage(void* dst, size_t bytes, absl::Time deadline,
                              bool* consumed) {
    if (!loopback()) {
      *consumed = true;
      return comm_->Group({{false, dst, bytes, options_.peer}}, comm_stream_,
                          deadline);
    }
    NcclLoopback* lb = comm_->loopback();
    absl::StatusOr<NcclLoopback::Message> m = lb->Take(deadline);
    *consumed = m.ok();
    if (!m.ok()) return m.status();
    if (m->bytes != bytes) {
      return absl::DataLossError(
          absl::StrCat("loopback: a message of ", m->bytes,
                       " bytes arrived where ", bytes, " were expected"));
    }
    const int self = comm_->rank();
    absl::Status s =
        comm_->Group({{true, const_cast<void*>(m->data), bytes, self},
                      {false, dst, bytes, self}},
                     comm_stream_, deadline);
    if (s.ok()) s = RecordAndWait(comm_stream_, deadline, "loopback message");
    if (s.ok()) lb->MarkReceived(m->seq);
    return s;
  }

  NcclCommunicator* const comm_;
  const NcclChannelOptions options_;
  cudaStream_t pack_stream_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  cudaStream_t unpack_stream_ = nullptr;
  cudaEvent_t scratch_event_ = nullptr;
  std::unique_ptr<BoxCopier> packer_;    // on pack_stream_
  std::unique_ptr<BoxCopier> unpacker_;  // on unpack_stream_
  // Allocated on first Send / first Receive: a channel used in one
  // direction holds one pool.
  Slot send_slots_[kSlots];
  Slot recv_slots_[kSlots];
  int next_send_ = 0;
  int next_recv_ = 0;
  absl::Status broken_;  // owned by the channel's thread; no lock needed
};

}  // namespace

absl::StatusOr<std::unique_ptr<Channel>> CreateNcclChannel(
    gpu::NcclCommunicator* comm, const NcclChannelOptions& options) {
  if (absl::Status s = gpu::IsViable(); !s.ok()) return s;
  if (comm == nullptr) {
    return absl::InvalidArgumentError("CreateNcclChannel: no communicator");
  }
  if (options.peer < 0 || options.peer >= comm->world_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("peer rank ", options.peer, " is not in ", comm->name()));
  }
  if (options.staging_bytes < (64 << 10)) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging slots must hold at least 64 KiB, got ",
                     options.staging_bytes));
  }
  auto channel = std::make_unique<NcclChannel>(comm, options);
  if (absl::Status s = channel->Init(); !s.ok()) return s;
  return std::unique_ptr<Channel>(std::move(channel));
}

}  // namespace ferry
