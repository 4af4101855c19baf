#include "cuda/nccl/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <glog/logging.h>
#include <nccl.h>

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "cuda/cuda_status.h"
#include "cuda/device.h"

namespace ferry {
namespace gpu {
namespace {

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES,
              "kNcclUniqueIdBytes must match nccl.h");

// Polling cadence: spin briefly (most waits end within microseconds), then
// sleep in short steps so a long wait costs no core.
class Poller {
 public:
  void Pause() {
    if (++rounds_ < 64) {
      std::this_thread::yield();
    } else {
      absl::SleepFor(absl::Microseconds(rounds_ < 1000 ? 20 : 200));
    }
  }

 private:
  int rounds_ = 0;
};

}  // namespace

absl::StatusOr<int> NcclVersionCode() {
  int version = 0;
  FERRY_NCCL_RETURN_IF_ERROR(ncclGetVersion(&version));
  return version;
}

std::string NcclVersionString(int code) {
  // NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch.
  return absl::StrCat(code / 10000, ".", (code % 10000) / 100, ".",
                      code % 100);
}

absl::StatusOr<std::string> NewNcclUniqueId() {
  ncclUniqueId id;
  FERRY_NCCL_RETURN_IF_ERROR(ncclGetUniqueId(&id));
  return std::string(id.internal, sizeof(id.internal));
}

// --- NcclLoopback. ---

void NcclLoopback::Attach() {
  absl::MutexLock lock(&mu_);
  gone_ = false;
}

bool NcclLoopback::Detach(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  gone_ = true;
  queue_.clear();  // not taken: dropped
  auto drained = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return received_ >= taken_ || !broken_.ok();
  };
  const bool ok = mu_.AwaitWithDeadline(absl::Condition(&drained), deadline);
  // Dropped messages count as received for anyone still waiting on them.
  received_ = next_seq_;
  taken_ = next_seq_;
  return ok;
}

absl::StatusOr<int64_t> NcclLoopback::Post(const void* data, size_t bytes) {
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return broken_;
  const int64_t seq = next_seq_++;
  queue_.push_back(Message{seq, data, bytes});
  return seq;
}

absl::Status NcclLoopback::WaitReceived(int64_t seq, absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto done = [this, seq]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return received_ > seq || !broken_.ok();
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&done), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        "loopback: message ", seq, " not received by the deadline"));
  }
  if (received_ > seq) return absl::OkStatus();
  return broken_;
}

absl::StatusOr<NcclLoopback::Message> NcclLoopback::Take(absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return !queue_.empty() || gone_ || !broken_.ok();
  };
  if (!mu_.AwaitWithDeadline(absl::Condition(&ready), deadline)) {
    return absl::DeadlineExceededError(
        "loopback: no bucket arrived by the deadline");
  }
  if (!broken_.ok()) return broken_;
  if (queue_.empty()) {
    return absl::UnavailableError("loopback: the sending channel is gone");
  }
  Message m = queue_.front();
  queue_.pop_front();
  taken_ = m.seq + 1;
  return m;
}

void NcclLoopback::MarkReceived(int64_t seq) {
  absl::MutexLock lock(&mu_);
  if (seq + 1 > received_) received_ = seq + 1;
}

void NcclLoopback::Break(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  if (broken_.ok()) broken_ = why;
  queue_.clear();
}

// --- NcclCommunicator. ---

NcclCommunicator::NcclCommunicator(const NcclCommunicatorOptions& options)
    : options_(options) {}

NcclCommunicator::~NcclCommunicator() {
  absl::MutexLock lock(&mu_);
  AbortLocked(absl::CancelledError("communicator destroyed"));
}

std::string NcclCommunicator::name() const {
  return absl::StrCat("nccl(epoch ", options_.epoch, ", rank ", options_.rank,
                      " of ", options_.world_size, ", device ",
                      options_.device, ")");
}

absl::StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::Create(
    const NcclCommunicatorOptions& options, absl::Time deadline) {
  if (options.unique_id.size() != kNcclUniqueIdBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("an NCCL unique id has ", kNcclUniqueIdBytes,
                     " bytes, got ", options.unique_id.size()));
  }
  if (options.world_size < 1 || options.rank < 0 ||
      options.rank >= options.world_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("NCCL rank ", options.rank, " is not in a world of ",
                     options.world_size));
  }
  if (absl::Status s = UseDevice(options.device); !s.ok()) return s;
  std::unique_ptr<NcclCommunicator> comm(new NcclCommunicator(options));
  ncclUniqueId id;
  std::memcpy(id.internal, options.unique_id.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // init returns at once; we poll with a deadline
  absl::MutexLock lock(&comm->mu_);
  ncclComm_t raw = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(
      &raw, options.world_size, id, options.rank, &config);
  comm->comm_ = raw;
  const absl::Status s = NcclStatus(
      r, absl::StrCat("ncclCommInitRankConfig(", comm->name(), ")"));
  if (!s.ok()) {
    comm->AbortLocked(s);
    return s;
  }
  if (absl::Status w = comm->AwaitIdleLocked(
          deadline, absl::StrCat(comm->name(), ": joining"));
      !w.ok()) {
    return w;
  }
  return comm;
}

absl::Status NcclCommunicator::AwaitIdleLocked(absl::Time deadline,
                                               absl::string_view what) {
  Poller poller;
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
    absl::Status s = NcclStatus(r, "ncclCommGetAsyncError");
    if (s.ok() && state != ncclInProgress) {
      s = NcclStatus(state, what);
      if (s.ok()) return s;
    }
    if (s.ok() && absl::Now() >= deadline) {
      s = absl::DeadlineExceededError(
          absl::StrCat(what, ": not done by the deadline"));
    }
    if (!s.ok()) {
      AbortLocked(s);
      return s;
    }
    poller.Pause();
  }
}

void NcclCommunicator::AbortLocked(const absl::Status& why) {
  if (broken_.ok()) {
    broken_ = why.ok() ? absl::CancelledError("aborted") : why;
  }
  if (comm_ != nullptr) {
    const ncclResult_t r = ncclCommAbort(comm_);
    LOG_IF(WARNING, r != ncclSuccess && r != ncclInProgress)
        << name() << ": ncclCommAbort: " << ncclGetErrorString(r);
    comm_ = nullptr;
  }
  loopback_.Break(broken_);
}

void NcclCommunicator::Abort(const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  AbortLocked(why);
}

absl::Status NcclCommunicator::health() const {
  absl::MutexLock lock(&mu_);
  return broken_;
}

absl::Status NcclCommunicator::Group(const std::vector<P2P>& ops, void* stream,
                                     absl::Time deadline) {
  absl::MutexLock lock(&mu_);
  if (!broken_.ok()) return broken_;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  absl::Status status = NcclStatus(ncclGroupStart(), "ncclGroupStart");
  for (const P2P& op : ops) {
    if (!status.ok()) break;
    status = op.send
                 ? NcclStatus(ncclSend(op.buffer, op.bytes, ncclUint8, op.peer,
                                       comm_, s),
                              absl::StrCat("ncclSend(", op.bytes,
                                           " bytes to rank ", op.peer, ")"))
                 : NcclStatus(ncclRecv(op.buffer, op.bytes, ncclUint8, op.peer,
                                       comm_, s),
                              absl::StrCat("ncclRecv(", op.bytes,
                                           " bytes from rank ", op.peer, ")"));
  }
  // A group that was started is always ended, even after an error.
  const absl::Status end = NcclStatus(ncclGroupEnd(), "ncclGroupEnd");
  if (status.ok()) status = end;
  if (!status.ok()) {
    status = absl::Status(status.code(),
                          absl::StrCat(name(), ": ", status.message()));
    AbortLocked(status);
    return status;
  }
  return AwaitIdleLocked(deadline, absl::StrCat(name(), ": issuing a group"));
}

absl::Status NcclCommunicator::Wait(void* event, absl::Time deadline,
                                    absl::string_view what) {
  Poller poller;
  while (true) {
    const cudaError_t e = cudaEventQuery(static_cast<cudaEvent_t>(event));
    if (e == cudaSuccess) return absl::OkStatus();
    {
      absl::MutexLock lock(&mu_);
      if (!broken_.ok()) return broken_;
      absl::Status s;
      if (e != cudaErrorNotReady) {
        s = CudaStatus(e,
                       absl::StrCat(name(), ": ", what, ": cudaEventQuery"));
      } else {
        ncclResult_t state = ncclSuccess;
        s = NcclStatus(ncclCommGetAsyncError(comm_, &state),
                       "ncclCommGetAsyncError");
        if (s.ok()) s = NcclStatus(state, absl::StrCat(name(), ": ", what));
        if (s.ok() && absl::Now() >= deadline) {
          s = absl::DeadlineExceededError(absl::StrCat(
              name(), ": ", what, ": not done by the deadline; aborted"));
        }
      }
      if (!s.ok()) {
        AbortLocked(s);
        return s;
      }
    }
    poller.Pause();  // unlocked, so other threads may issue work meanwhile
  }
}

}  // namespace gpu
}  // namespace ferry
