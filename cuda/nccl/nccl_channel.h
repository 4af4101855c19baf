// The nccl backend: a Channel between two daemons' GPUs over NCCL.
//
// Design §4, "other node, GPU": pack kernel -> ncclSend/ncclRecv -> unpack
// kernel. Each side owns a device staging pool of two slots (double
// buffered, `staging_bytes` each). The sender packs chunk k of a bucket
// into a slot on its pack stream while chunk k-1 is on the wire on its
// comm stream; the receiver receives chunk k into a slot on its comm
// stream while chunk k-1 is unpacked on its unpack stream. Streams are
// chained with events, never with host waits, except where the contract
// needs one (Send returns once the bucket is packed; Receive once it
// landed).
//
// On the wire a bucket is a 64-byte header (id, bytes, chunk size and a
// digest of the boxes' extents and unit sizes), then its payload (boxes
// packed back to back, bucket_segments.h) in chunks of at most the
// sender's staging size, cut at unit boundaries. The receiver checks the
// header against its own view before it posts a single payload receive:
// a different id, size or box layout is DATA_LOSS naming both buckets.
//
// Failure: every wait polls with the caller's deadline; on a deadline or an
// NCCL error the communicator is aborted (nccl_communicator.h) and the
// channel is broken: every later call returns that error and the daemon
// reopens the channel at a higher epoch. (Unlike tcp, a remote receive that
// timed out cannot be taken back, so a deadline breaks the channel here.)
// In loopback (peer == own rank) a receive whose deadline passes before a
// bucket arrived consumes nothing and leaves the channel usable.
//
// Lifetime and threading: as Channel (transport.h); one owning thread. The
// communicator must outlive the channel; one sending channel per
// communicator direction (and per loopback).
#ifndef FERRY_CUDA_NCCL_NCCL_CHANNEL_H_
#define FERRY_CUDA_NCCL_NCCL_CHANNEL_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "cuda/nccl/nccl_communicator.h"
#include "transport/transport.h"

namespace ferry {

struct NcclChannelOptions {
  // The other end's rank in the communicator; the communicator's own rank
  // makes a loopback channel.
  int peer = 0;
  // Bytes of each of the two device staging slots. A receiver accepts
  // chunks up to its own size; both ends normally use the same value.
  int64_t staging_bytes = 64 << 20;
  // Waits in the destructor for sends in flight before the communicator
  // is aborted to reclaim the staging.
  absl::Duration close_timeout = absl::Seconds(5);
};

// A channel on `comm` (not owned; must outlive it), on comm's device.
// NotViable without a GPU; INVALID_ARGUMENT for a bad peer or size.
absl::StatusOr<std::unique_ptr<Channel>> CreateNcclChannel(
    gpu::NcclCommunicator* comm, const NcclChannelOptions& options);

}  // namespace ferry

#endif  // FERRY_CUDA_NCCL_NCCL_CHANNEL_H_
