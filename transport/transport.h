// Transport: how bucket bytes get from source memory to destination memory.
//
// The planner (core/planner.h) decides which boxes move; a transport moves
// them. Every backend implements the same two interfaces, and one
// conformance suite (tests/transport/) runs against each:
//
//   local  (transport/local)  same node, host memory: one copy per
//          byte, source region straight into destination region, spread
//          over worker threads.
//   tcp    (transport/tcp)    between daemons: the sender packs a
//          bucket, the wire carries it, the receiver unpacks it; bucket
//          k+1 is packed while bucket k is on the wire.
//   cuda_ipc, nccl (cuda/)           the GPU equivalents.
//
// Memory is described by resolved regions: a base pointer into memory the
// daemon has mapped (a client's shared-memory segment, a staging buffer, a
// CUDA IPC mapping) plus strides. Transports never see ranks or pieces.
//
// Threading: a Channel is owned by one thread (the daemon's per-channel
// loop); its calls are not reentrant. CopyEngine is thread-safe.
#ifndef FERRY_TRANSPORT_TRANSPORT_H_
#define FERRY_TRANSPORT_TRANSPORT_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/geometry.h"

namespace ferry {

// One side of a box copy: the address of the box's first unit, and strides
// in units.
struct RegionView {
  uint8_t* base = nullptr;
  Dims strides;
};

// A box copy whose both ends are mapped in this process.
struct LocalCopy {
  RegionView src;
  RegionView dst;
  Dims extent;  // storage units
  int64_t unit_bytes = 0;
};

// A bucket as one side of a channel sees it: the boxes in wire order, and
// this side's region of each (source regions on the sender, destination
// regions on the receiver).
struct BucketView {
  uint64_t id = 0;  // (version, bucket index) folded; both sides agree
  std::vector<RegionView> regions;
  std::vector<Dims> extents;  // storage units, per box
  std::vector<int64_t> unit_bytes;
  int64_t bytes = 0;  // sum of the boxes' bytes
};

// Same-node bulk copies. Thread-safe: several threads may call Run at once.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  virtual std::string name() const = 0;
  // Copies all boxes; returns when every byte has landed. The boxes'
  // destinations must not overlap one another (the order is unspecified).
  // INVALID_ARGUMENT, before any byte moves, when a copy is malformed.
  virtual absl::Status Run(const std::vector<LocalCopy>& copies) = 0;
};

// One direction of a connection between two daemons.
//
// Ownership and threading: one thread (the daemon's per-channel loop) owns a
// Channel and makes all its calls; they are not reentrant. A backend may run
// threads of its own (ucx puts bucket k on the wire while the caller packs
// bucket k+1), but they never call back into the caller.
//
// Failure: an error that leaves the two ends disagreeing about where the
// next bucket starts (a half-sent or half-received bucket, DATA_LOSS) breaks
// the channel for good: every later call returns that error, and the owner
// reconnects. An error that consumed nothing (a deadline that expired before
// a bucket's first byte) leaves it usable.
class Channel {
 public:
  virtual ~Channel() = default;
  // Sender side: puts the bucket's boxes on the wire, in order, or packs
  // them into staging queued for it (a backend's choice: tcp writes the
  // bucket before it returns, ucx queues it). Either way the source regions
  // may change as soon as Send returns. Waits at most until `deadline` (for
  // the wire, or for free staging), and the bucket must be on the wire by
  // then. An error in putting an earlier bucket on the wire is reported
  // here or by Flush.
  virtual absl::Status Send(const BucketView& bucket, absl::Time deadline) = 0;
  // Sender side: waits until every bucket that Send accepted has been handed
  // to the network (not: received; only the receiver's Receive says that),
  // and returns the first error of any of them. Destroying a channel
  // discards buckets not yet on the wire; Flush first to keep them.
  virtual absl::Status Flush(absl::Time deadline) = 0;
  // Receiver side: receives the bucket with the same id and unpacks it.
  // Fails with DEADLINE_EXCEEDED past `deadline`, UNAVAILABLE when the
  // peer is gone, DATA_LOSS when the bytes that arrive do not match (wrong
  // id or size, bad checksum). On any error the destination regions may
  // hold part of the bucket: the caller treats them as dirty.
  virtual absl::Status Receive(const BucketView& bucket,
                               absl::Time deadline) = 0;
};

// The accepting end of a backend's channels between daemons (tcp/'s
// ListenTcp). Owned by one thread.
class ChannelListener {
 public:
  virtual ~ChannelListener() = default;
  // The port it listens on (an ephemeral one when asked for port 0).
  virtual int port() const = 0;
  // The next connection, as a channel. DEADLINE_EXCEEDED when none comes;
  // PERMISSION_DENIED (connection closed) when a connection does not prove
  // itself (the backend's token); call again for the next one.
  virtual absl::StatusOr<std::unique_ptr<Channel>> Accept(
      absl::Time deadline) = 0;
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TRANSPORT_H_
