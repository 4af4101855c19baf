// CUDA IPC registration: mapping a client's device allocations once.
//
// A client (trainer or engine rank) registers each CUDA allocation that
// holds its tensors by sending the allocation's cudaIpcMemHandle_t (64
// bytes). The daemon opens it (cudaIpcOpenMemHandle) on the device whose
// kernels will touch it and keeps the mapping until the client deregisters:
// every version reuses it. Opening per tensor per version is what makes
// naive weight sync slow: one RL framework (slime) measured opening and
// closing IPC handles at 81% of its sync time. Here the mapping is keyed by
// (device, handle bytes), opened on the first Register and reference
// counted, so a thousand tensors in one allocation cost one open.
//
// The opening itself goes through IpcMapper, a seam (like LevelDB's Env):
// the CUDA mapper in production, a fake in tests that counts calls on any
// machine.
//
// Threading: IpcMemoryCache is thread-safe. Mappings live until their last
// Deregister or the cache's destruction; the caller must not use a base
// pointer after releasing its reference.
#ifndef FERRY_CUDA_IPC_IPC_MEMORY_CACHE_H_
#define FERRY_CUDA_IPC_IPC_MEMORY_CACHE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace ferry {
namespace gpu {

// sizeof(cudaIpcMemHandle_t).
constexpr size_t kCudaIpcHandleBytes = 64;

// Opens and closes IPC mappings. Implementations are thread-safe.
class IpcMapper {
 public:
  virtual ~IpcMapper() = default;
  // Maps the allocation `handle` names into this process, usable by
  // kernels on `device`; returns its base address.
  virtual absl::StatusOr<uint8_t*> Open(int device,
                                        absl::string_view handle) = 0;
  virtual absl::Status Close(int device, uint8_t* base) = 0;
};

// cudaIpcOpenMemHandle (with cudaIpcMemLazyEnablePeerAccess, so an
// allocation of another GPU on the node maps over NVLink) and
// cudaIpcCloseMemHandle. Open fails NotViable without a GPU.
std::unique_ptr<IpcMapper> CreateCudaIpcMapper();

// The 64 bytes of cudaIpcGetMemHandle for `device_ptr`, which must be the
// base of a cudaMalloc allocation (IPC names allocations, not pointers
// inside them); what a client sends to register its memory.
absl::StatusOr<std::string> ExportCudaIpcHandle(const void* device_ptr);

class IpcMemoryCache {
 public:
  explicit IpcMemoryCache(std::unique_ptr<IpcMapper> mapper);
  IpcMemoryCache(const IpcMemoryCache&) = delete;
  IpcMemoryCache& operator=(const IpcMemoryCache&) = delete;
  // Closes every mapping still open (errors are logged, not returned).
  ~IpcMemoryCache();

  // The base of the mapping of `handle` on `device`, opened on first use;
  // each call takes a reference. INVALID_ARGUMENT when the handle is not
  // kCudaIpcHandleBytes long; the mapper's error when it cannot be opened
  // (then nothing is cached, and a later Register tries again).
  absl::StatusOr<uint8_t*> Register(int device, absl::string_view handle);
  // Drops one reference; closes the mapping with the last. NOT_FOUND when
  // (device, handle) is not registered.
  absl::Status Deregister(int device, absl::string_view handle);

  // Mappings currently open.
  size_t size() const;
  // Mapper Open calls that succeeded since construction: the number a
  // test checks to see that an allocation is opened once.
  int64_t opens() const;

 private:
  struct Mapping {
    uint8_t* base = nullptr;
    int64_t references = 0;
  };
  using Key = std::pair<int, std::string>;

  const std::unique_ptr<IpcMapper> mapper_;
  mutable absl::Mutex mu_;
  // Opening happens under mu_: two first Registers of one handle must not
  // both open it, and opens are rare (once per allocation).
  std::map<Key, Mapping> mappings_ ABSL_GUARDED_BY(mu_);
  int64_t opens_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace gpu
}  // namespace ferry

#endif  // FERRY_CUDA_IPC_IPC_MEMORY_CACHE_H_
