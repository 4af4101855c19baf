// GpuReads: pieces of a trainer's CUDA tensors read into pinned host
// memory, for work ferryd does on the CPU over them. FP8 in flight's
// quantize step (plans/fp8_quantizer.h on the coordinator's node,
// transfer/route_quantizers.h on a member) reads a GPU trainer's bf16
// pieces this way, one tensor at a time, then quantizes with the CPU
// routine (core/fp8_blocks.h). Quantizing where the tensor is
// (QuantizeBlocksOnGpu, cuda/kernels/) is not wired yet.
//
// Owner: its user (a quantizer, for a plan's lifetime): the scratch is
// allocated and pinned at the first read and reused by later versions.
// Threading: thread-safe. At most `slots` reads are held at once; a Read
// waits for a free slot.
#ifndef FERRY_DAEMON_MEMORY_GPU_READS_H_
#define FERRY_DAEMON_MEMORY_GPU_READS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/fp8_sources.h"
#include "daemon/memory/memory_map.h"
#include "transport/device_memory.h"

namespace ferry {

class GpuReads {
 public:
  // `devices` (not owned; null: a read of GPU memory is
  // FAILED_PRECONDITION); `slots` scratch buffers of `slot_bytes` each.
  GpuReads(DeviceMemory* devices, int64_t slot_bytes, int slots);
  GpuReads(const GpuReads&) = delete;
  int64_t slot_bytes() const { return slot_bytes_; }
  GpuReads& operator=(const GpuReads&) = delete;
  ~GpuReads();

  // A tensor's pieces as the CPU reads them: those in GPU memory replaced
  // by their host copies. Holds a scratch slot until destroyed.
  class Host {
   public:
    ~Host();
    const std::vector<HeldPiece>& held() const { return held_; }
    const std::vector<std::vector<const uint8_t*>>& bases() const {
      return bases_;
    }

   private:
    friend class GpuReads;
    GpuReads* owner_ = nullptr;
    int slot_ = -1;
    std::vector<Piece> copies_;  // the host pieces `held_` points at
    std::vector<HeldPiece> held_;
    std::vector<std::vector<const uint8_t*>> bases_;
  };

  // The bytes of `held`'s pieces that lie in GPU memory (`maps[rank]`, a
  // buffer on_device), elements of `dtype`: what one read needs of a slot.
  static int64_t GpuBytes(const std::vector<HeldPiece>& held,
                          const std::vector<const MemoryMap*>& maps,
                          DType dtype);

  // Copies those pieces into a slot with each GPU's copy engine and returns
  // `held` and `bases` (as CheckReadable and QuantizeParam take them) with
  // each such piece replaced by its contiguous host copy, appended to
  // `bases` as a rank of its own. RESOURCE_EXHAUSTED for a tensor larger
  // than a slot; FAILED_PRECONDITION without GPUs; the engine's error.
  absl::StatusOr<std::unique_ptr<Host>> Read(
      const std::vector<HeldPiece>& held,
      const std::vector<std::vector<const uint8_t*>>& bases,
      const std::vector<const MemoryMap*>& maps, DType dtype)
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Slot {
    uint8_t* data = nullptr;  // mmap'ed
    std::unique_ptr<PinnedHost> pin;
  };
  absl::StatusOr<int> Acquire() ABSL_LOCKS_EXCLUDED(mu_);
  void Release(int slot) ABSL_LOCKS_EXCLUDED(mu_);

  DeviceMemory* const devices_;
  const int64_t slot_bytes_;
  absl::Mutex mu_;
  std::vector<Slot> slots_ ABSL_GUARDED_BY(mu_);  // made at the first read
  std::vector<bool> busy_ ABSL_GUARDED_BY(mu_);
  const int count_;
};

// Runs `work` on `held`'s pieces as the CPU reads them: with `reads` (null
// when none of them is in GPU memory), those in GPU memory read into host
// scratch first (GpuReads::Read); under the memory fault guard, so that a
// client's memory that went away is an error naming it, not a crash. The
// quantize step's way of reading a tensor's pieces, on the coordinator and
// on members.
absl::Status RunOnHostPieces(
    GpuReads* reads, const std::vector<HeldPiece>& held,
    const std::vector<std::vector<const uint8_t*>>& bases,
    const std::vector<const MemoryMap*>& maps, DType dtype,
    const std::function<absl::Status(
        const std::vector<HeldPiece>&,
        const std::vector<std::vector<const uint8_t*>>&)>& work);

}  // namespace ferry

#endif  // FERRY_DAEMON_MEMORY_GPU_READS_H_
