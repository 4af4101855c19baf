// NCCL communicators that never hang their caller.
//
// A daemon joins an NCCL communicator per data channel (design §4, "other
// node, GPU"): the rank-0 daemon makes a unique id (NewNcclUniqueId), sends
// its 128 bytes to the other daemons over gRPC (OpenChannelRequest.nccl,
// proto/ferry/v1/peer.proto), and each joins with its rank, the world size
// and the channel's epoch. A hung or failed communicator is aborted and
// replaced by one of a higher epoch, never waited on (design §5): so
// initialisation is non-blocking (ncclCommInitRankConfig with
// config.blocking = 0), and every wait here polls — the CUDA event that
// marks the work, and ncclCommGetAsyncError — until done, an error, or the
// caller's deadline; on error or deadline the communicator is aborted
// (ncclCommAbort), and every later call fails with the first reason.
//
// NCCL runs a communicator's operations in issue order. Two ranks that
// each send and then receive on one communicator can deadlock (each send
// waits for a receive queued behind the other's send), so a communicator
// carries one direction between its ranks: one per channel.
//
// Loopback: a communicator of one rank (or a rank sending to itself) moves
// bytes with ncclSend and ncclRecv to self, which must be in one group.
// NcclLoopback is the meeting point: the sending channel posts its ready
// device buffers there; the receiving channel takes each and issues the
// grouped send/recv pair itself. Single-GPU tests run the NCCL data path
// this way.
//
// Threading: thread-safe. NCCL calls on the communicator are serialised by
// an internal mutex (NCCL communicators are not thread-safe). No CUDA or
// NCCL type appears in this header.
#ifndef FERRY_CUDA_NCCL_NCCL_COMMUNICATOR_H_
#define FERRY_CUDA_NCCL_NCCL_COMMUNICATOR_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

struct ncclComm;  // nccl.h: typedef struct ncclComm* ncclComm_t

namespace ferry {
namespace gpu {

// NCCL_UNIQUE_ID_BYTES.
constexpr size_t kNcclUniqueIdBytes = 128;

// ncclGetVersion: e.g. 22809 for 2.28.9. Works without a GPU.
absl::StatusOr<int> NcclVersionCode();
// "2.28.9" for 22809.
std::string NcclVersionString(int code);

// ncclGetUniqueId, as the raw bytes the daemons exchange. Needs no GPU
// (it opens the bootstrap socket), only a network interface.
absl::StatusOr<std::string> NewNcclUniqueId();

struct NcclCommunicatorOptions {
  int device = 0;  // the local GPU that takes `rank`
  int rank = 0;
  int world_size = 1;
  int64_t epoch = 1;      // the channel generation (OpenChannelRequest)
  std::string unique_id;  // kNcclUniqueIdBytes raw bytes
};

// The meeting point of a loopback sender and receiver (see above).
class NcclLoopback {
 public:
  struct Message {
    int64_t seq = 0;
    const void* data = nullptr;  // device memory, ready (packed) when posted
    size_t bytes = 0;
  };

  // Every loopback channel attaches while it lives. Detach drops messages
  // not yet taken (the detaching sender's buckets not yet "on the wire")
  // and waits, until `deadline`, for those taken to be received; false
  // when some still are in flight (their memory must not be freed then).
  // After a Detach, a receiver finding nothing queued gets UNAVAILABLE
  // (the peer is gone) until another channel attaches.
  void Attach();
  bool Detach(absl::Time deadline);
  // Queues a message; returns its sequence number.
  absl::StatusOr<int64_t> Post(const void* data, size_t bytes);
  // Waits until message `seq` and all before it are received.
  absl::Status WaitReceived(int64_t seq, absl::Time deadline);

  // Receiver side: the next message. DEADLINE_EXCEEDED (nothing taken),
  // UNAVAILABLE (no sender), or the reason the loopback broke.
  absl::StatusOr<Message> Take(absl::Time deadline);
  // The taken message `seq` has landed; the sender may reuse its memory.
  void MarkReceived(int64_t seq);

  // Every later call fails with `why`; queued messages are dropped.
  void Break(const absl::Status& why);

 private:
  absl::Mutex mu_;
  std::deque<Message> queue_ ABSL_GUARDED_BY(mu_);
  int64_t next_seq_ ABSL_GUARDED_BY(mu_) = 0;
  // Every message with seq < received_ has been received or dropped.
  int64_t received_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t taken_ ABSL_GUARDED_BY(mu_) = 0;  // messages with seq < taken_
  bool gone_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
};

class NcclCommunicator {
 public:
  // One point-to-point operation of a group.
  struct P2P {
    bool send = true;
    void* buffer = nullptr;  // device memory
    size_t bytes = 0;
    int peer = 0;
  };

  // Joins the communicator: waits, polling, until every rank has joined.
  // DEADLINE_EXCEEDED (after aborting the half-made communicator) when they
  // have not by `deadline`; INVALID_ARGUMENT for a malformed id, rank or
  // world size; NotViable without a GPU.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(
      const NcclCommunicatorOptions& options, absl::Time deadline);

  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;
  // Aborts (ncclCommAbort): never waits for peers. Channels using the
  // communicator must be destroyed first.
  ~NcclCommunicator();

  int device() const { return options_.device; }
  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  int64_t epoch() const { return options_.epoch; }
  // "nccl(epoch 3, rank 1 of 2, device 0)"
  std::string name() const;

  // Issues `ops` as one group on `stream` (a cudaStream_t) and waits until
  // NCCL has taken them (not: completed; record an event after and Wait).
  // On an error or past `deadline`: aborts, and returns why.
  absl::Status Group(const std::vector<P2P>& ops, void* stream,
                     absl::Time deadline);
  // Polls `event` (a cudaEvent_t, recorded) until it completes, checking
  // the communicator's asynchronous error too. On an error or past
  // `deadline`: aborts, and returns why (DEADLINE_EXCEEDED naming `what`).
  absl::Status Wait(void* event, absl::Time deadline, absl::string_view what);

  // Aborts the communicator (idempotent): NCCL work in flight is cancelled
  // and every later call returns `why`.
  void Abort(const absl::Status& why);
  // OK, or why the communicator was aborted.
  absl::Status health() const;

  NcclLoopback* loopback() { return &loopback_; }

 private:
  explicit NcclCommunicator(const NcclCommunicatorOptions& options);
  // REQUIRES: mu_ is held. Polls the async state until it leaves
  // ncclInProgress; aborts on error or deadline.
  absl::Status AwaitIdleLocked(absl::Time deadline, absl::string_view what)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void AbortLocked(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const NcclCommunicatorOptions options_;
  mutable absl::Mutex mu_;
  ncclComm* comm_ ABSL_GUARDED_BY(mu_) = nullptr;  // nullptr once aborted
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  NcclLoopback loopback_;
};

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_NCCL_NCCL_COMMUNICATOR_H_
