// SharedMemoryRegion: host memory that two processes map at once.
//
// A client registers its host tensors with the daemon by putting them in a
// shared-memory region and handing over the region's name; the daemon maps
// the same pages and the local copy engine moves bytes between two clients'
// regions directly (one copy per byte, design §4). Two kinds:
//
//   named  (Create / Open)        POSIX shm: a file /dev/shm/<name>, mode
//                                 0600, that any process of the same user
//                                 opens by name until it is unlinked.
//   memfd  (CreateMemfd /         an anonymous memfd with no name to leak or
//           OpenByPath)           clean up; another process of the same user
//                                 maps it through /proc/<pid>/fd/<n> while
//                                 the creator keeps it open.
//
// Lifetime: the object owns one mapping; the destructor unmaps it. The
// creator of a named region also unlinks it on destruction unless Unlink()
// was already called; mappings in other processes stay valid after the
// unlink. A memfd lives until every fd and mapping of it is gone.
//
// Hazard: a process that shrinks a shared file under another's mapping makes
// the other's accesses fault (SIGBUS). CreateMemfd seals its memfd against
// resizing and OpenByPath refuses memfds that are not sealed, so a client
// cannot crash the daemon that way; POSIX shm cannot be sealed, so the
// daemon copies from and into mappings only under a MemoryFaultGuard
// (memory_fault_guard.h), which turns that SIGBUS into an error.
//
// Threading: not synchronized; the pointer it hands out is plain memory.
#ifndef FERRY_TRANSPORT_SHARED_MEMORY_H_
#define FERRY_TRANSPORT_SHARED_MEMORY_H_

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace ferry {

// Whose rights an Open uses. ferryd often runs with more rights than its
// clients (root on a GPU node): it opens a region a client names only if
// that client could open it itself, judged from the open file (no race
// with a rename): the caller is root, or the file's owner, group or other
// permission bits for the caller's uid and primary gid grant read (and
// write, for memory ferryd writes into). Supplementary groups are not
// consulted, so this is at most as permissive as open(2) would be.
struct RegionAccess {
  bool check = false;  // false: no caller to check (the daemon's own)
  uid_t uid = 0;
  gid_t gid = 0;
  bool write = true;   // destinations are written; sources only read
};

class SharedMemoryRegion {
 public:
  // Creates /dev/shm/<name> (mode 0600, O_EXCL: never an existing file) of
  // `bytes` bytes and maps it. The name is "/ferry-<hint>-<pid>-<n>" with
  // the hint reduced to [A-Za-z0-9_.-]; name() returns it for Open in the
  // other process. REQUIRES: bytes > 0.
  static absl::StatusOr<SharedMemoryRegion> Create(absl::string_view name_hint,
                                                   int64_t bytes);
  // Maps the first `bytes` bytes of an existing named region. A region
  // smaller than `bytes` is INVALID_ARGUMENT naming it, never a mapping that
  // would fault past the end.
  // PERMISSION_DENIED when `access` says the caller could not open it.
  static absl::StatusOr<SharedMemoryRegion> Open(const std::string& name,
                                                 int64_t bytes,
                                                 const RegionAccess& access = {});

  // Creates a sealed (fixed-size) memfd of `bytes` bytes and maps it; the fd
  // stays open for the object's lifetime so that name(), which is
  // "/proc/<pid>/fd/<n>", stays valid for OpenByPath in another process.
  static absl::StatusOr<SharedMemoryRegion> CreateMemfd(int64_t bytes);
  // Maps the first `bytes` bytes of another process's memfd or shm file
  // through "/proc/<pid>/fd/<n>" (no other path is accepted, so a client
  // cannot point the daemon at an ordinary file). The file must be sealed
  // against shrinking (see the hazard above) and at least `bytes` long.
  // PERMISSION_DENIED as for Open.
  static absl::StatusOr<SharedMemoryRegion> OpenByPath(
      const std::string& path, int64_t bytes, const RegionAccess& access = {});
  // Maps the first `bytes` bytes of a regular file read-only (PROT_READ):
  // a checkpoint registered as source memory. `path` absolute;
  // access.write must be false (INVALID_ARGUMENT: file regions are never
  // written); the caller must be able to read the file (PERMISSION_DENIED).
  // data() of such a region must not be written.
  static absl::StatusOr<SharedMemoryRegion> OpenFile(
      const std::string& path, int64_t bytes, const RegionAccess& access = {});

  SharedMemoryRegion(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion& operator=(const SharedMemoryRegion&) = delete;
  SharedMemoryRegion(SharedMemoryRegion&& other) noexcept;
  SharedMemoryRegion& operator=(SharedMemoryRegion&& other) noexcept;
  ~SharedMemoryRegion();

  uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }
  // What another process passes to Open (named) or OpenByPath (memfd).
  const std::string& name() const { return name_; }
  // True when this object created the region (and so unlinks it).
  bool owner() const { return owner_; }

  // Removes a named region's name so no further process can open it;
  // mappings stay valid. A second call, or a call on a memfd, is a no-op.
  absl::Status Unlink();

 private:
  enum class Kind { kNamed, kMemfd, kFile };
  SharedMemoryRegion(Kind kind, uint8_t* data, int64_t size, std::string name,
                     int fd, bool owner);
  void Release();

  Kind kind_ = Kind::kNamed;
  uint8_t* data_ = nullptr;
  int64_t size_ = 0;
  std::string name_;
  int fd_ = -1;  // a created memfd's fd (its name refers to it); else -1
  bool owner_ = false;
  bool unlinked_ = false;
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_SHARED_MEMORY_H_
