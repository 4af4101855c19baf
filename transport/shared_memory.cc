#include "transport/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <atomic>
#include <random>
#include <cctype>
#include <cerrno>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "glog/logging.h"
#include "transport/os_error.h"

namespace ferry {
namespace {

constexpr int kCreateAttempts = 16;
constexpr size_t kMaxHintChars = 64;

absl::Status CheckRequestedSize(absl::string_view what, int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory region ", what, ": size must be positive, got ", bytes));
  }
  return absl::OkStatus();
}

// Shm names are one path component; keep the hint printable and short so
// the name stays readable in /dev/shm and far below NAME_MAX.
std::string SanitizeHint(absl::string_view hint) {
  std::string out;
  for (char c : hint.substr(0, kMaxHintChars)) {
    const bool ok = absl::ascii_isalnum(static_cast<unsigned char>(c)) ||
                    c == '_' || c == '.' || c == '-';
    out.push_back(ok ? c : '_');
  }
  if (out.empty()) out = "region";
  return out;
}

// "/proc/<pid or self>/fd/<n>": the only paths OpenByPath accepts.
bool IsProcFdPath(absl::string_view path) {
  auto digits = [](absl::string_view s) {
    if (s.empty()) return false;
    for (char c : s) {
      if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
    }
    return true;
  };
  if (!absl::ConsumePrefix(&path, "/proc/")) return false;
  const size_t slash = path.find('/');
  if (slash == absl::string_view::npos) return false;
  const absl::string_view pid = path.substr(0, slash);
  if (pid != "self" && !digits(pid)) return false;
  path.remove_prefix(slash);
  return absl::ConsumePrefix(&path, "/fd/") && digits(path);
}

// Whether the caller `access` describes could open a file of `st`'s owner
// and mode for what it needs (open(2)'s rule, primary group only).
absl::Status CheckAccess(const struct stat& st, const RegionAccess& access,
                         const std::string& what) {
  if (!access.check || access.uid == 0) return absl::OkStatus();
  mode_t read = S_IROTH, write = S_IWOTH;
  if (st.st_uid == access.uid) {
    read = S_IRUSR;
    write = S_IWUSR;
  } else if (st.st_gid == access.gid) {
    read = S_IRGRP;
    write = S_IWGRP;
  }
  const bool ok = (st.st_mode & read) != 0 &&
                  (!access.write || (st.st_mode & write) != 0);
  if (ok) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(
      "shared memory region ", what, " belongs to uid ", st.st_uid, " gid ",
      st.st_gid, " with mode 0", absl::Hex(st.st_mode & 0777), ": the caller ",
      "(uid ", access.uid, ", gid ", access.gid, ") may not ",
      access.write ? "write" : "read", " it, so ferryd does not map it"));
}

// For a caller that is not root: the file behind `fd` is its own. ferryd
// opened it with its own rights, so it must not read or write for the
// caller a file the caller could not have opened itself.
absl::Status CheckOwnedByCaller(int fd, const RegionAccess& access,
                                const std::string& what) {
  if (!access.check || access.uid == 0) return absl::OkStatus();
  struct stat st;
  if (::fstat(fd, &st) != 0 || st.st_uid != access.uid) {
    return absl::PermissionDeniedError(absl::StrCat(
        what, " does not belong to the caller (uid ", access.uid,
        "), so ferryd does not map it"));
  }
  return absl::OkStatus();
}

// Checks the file behind `fd` holds at least `bytes` bytes, that the caller
// may open it, and maps them.
absl::StatusOr<uint8_t*> MapAtLeast(int fd, const std::string& what,
                                    int64_t bytes,
                                    const RegionAccess& access = {},
                                    bool read_only = false) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return ErrnoStatus(absl::StrCat("fstat(", what, ")"), errno);
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared memory region ", what, " is not a regular file"));
  }
  if (absl::Status s = CheckAccess(st, access, what); !s.ok()) return s;
  // The daemon touches every page it maps (MemoryMap prefaults them), and a
  // touched hole of a tmpfs file takes a page: a sparse file with more
  // holes than its filesystem has room for would fill /dev/shm and then
  // fault. Refused here, before any page is taken.
  const int64_t allocated = static_cast<int64_t>(st.st_blocks) * 512;
  struct statfs fs;
  if (allocated < bytes && ::fstatfs(fd, &fs) == 0 && fs.f_blocks > 0) {
    const int64_t free_bytes =
        static_cast<int64_t>(fs.f_bavail) * static_cast<int64_t>(fs.f_bsize);
    if (bytes - allocated > free_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "shared memory region ", what, " is sparse: ", bytes - allocated,
          " of its ", bytes, " bytes have no pages yet, and its filesystem "
          "has ", free_bytes, " bytes free"));
    }
  }
  if (st.st_size < bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory region ", what, " holds ", st.st_size,
        " bytes but ", bytes, " were requested"));
  }
  void* p = ::mmap(nullptr, static_cast<size_t>(bytes),
                   read_only ? PROT_READ : PROT_READ | PROT_WRITE, MAP_SHARED,
                   fd, 0);
  if (p == MAP_FAILED) {
    return ErrnoStatus(absl::StrCat("mmap(", what, ", ", bytes, " bytes)"),
                       errno);
  }
  return static_cast<uint8_t*>(p);
}

}  // namespace

SharedMemoryRegion::SharedMemoryRegion(Kind kind, uint8_t* data, int64_t size,
                                       std::string name, int fd, bool owner)
    : kind_(kind),
      data_(data),
      size_(size),
      name_(std::move(name)),
      fd_(fd),
      owner_(owner) {}

absl::StatusOr<SharedMemoryRegion> SharedMemoryRegion::Create(
    absl::string_view name_hint, int64_t bytes) {
  if (absl::Status s = CheckRequestedSize(name_hint, bytes); !s.ok()) return s;
  // A process-wide counter plus the pid keeps names unique among live
  // processes; O_EXCL plus retry covers a stale file left by a dead process
  // that had the same pid. A random per-process nonce keeps processes in
  // different pid namespaces (sandboxed tests: the same small pids every
  // run, and files left by kill -9) from walking the same names.
  static std::atomic<uint64_t> counter{0};
  static const uint32_t nonce = [] {
    std::random_device rd;
    return static_cast<uint32_t>(rd());
  }();
  const std::string prefix =
      absl::StrCat("/ferry-", SanitizeHint(name_hint), "-", ::getpid(), "-",
                   absl::Hex(nonce), "-");
  std::string name;
  int fd = -1;
  for (int attempt = 0; attempt < kCreateAttempts && fd < 0; ++attempt) {
    name = absl::StrCat(prefix, counter.fetch_add(1));
    fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0 && errno != EEXIST) {
      return ErrnoStatus(absl::StrCat("shm_open(", name, ")"), errno);
    }
  }
  if (fd < 0) {
    return ErrnoStatus(absl::StrCat("shm_open(", name, ")"), EEXIST);
  }
  // The mode passed to shm_open is filtered by the umask; set it exactly so
  // a permissive or restrictive umask changes nothing.
  absl::Status status;
  if (::fchmod(fd, 0600) != 0) {
    status = ErrnoStatus(absl::StrCat("fchmod(", name, ")"), errno);
  } else if (::ftruncate(fd, bytes) != 0) {
    status = ErrnoStatus(absl::StrCat("ftruncate(", name, ", ", bytes, ")"),
                         errno);
  }
  absl::StatusOr<uint8_t*> data =
      status.ok() ? MapAtLeast(fd, name, bytes) : status;
  ::close(fd);  // the mapping keeps the pages; the name keeps the file
  if (!data.ok()) {
    ::shm_unlink(name.c_str());
    return data.status();
  }
  return SharedMemoryRegion(Kind::kNamed, *data, bytes, name, -1,
                            /*owner=*/true);
}

absl::StatusOr<SharedMemoryRegion> SharedMemoryRegion::Open(
    const std::string& name, int64_t bytes, const RegionAccess& access) {
  if (absl::Status s = CheckRequestedSize(name, bytes); !s.ok()) return s;
  // One path component after the leading slash, as shm_open requires;
  // anything else is a client error, not a path to resolve.
  if (name.size() < 2 || name[0] != '/' ||
      name.find('/', 1) != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory name \"", name, "\" is not of the form /<name>"));
  }
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus(absl::StrCat("shm_open(", name, ")"), errno);
  absl::StatusOr<uint8_t*> data = MapAtLeast(fd, name, bytes, access);
  ::close(fd);
  if (!data.ok()) return data.status();
  return SharedMemoryRegion(Kind::kNamed, *data, bytes, name, -1,
                            /*owner=*/false);
}

absl::StatusOr<SharedMemoryRegion> SharedMemoryRegion::CreateMemfd(
    int64_t bytes) {
  if (absl::Status s = CheckRequestedSize("memfd", bytes); !s.ok()) return s;
  const int fd = ::memfd_create("ferry", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (fd < 0) return ErrnoStatus("memfd_create(ferry)", errno);
  const std::string name = absl::StrCat("/proc/", ::getpid(), "/fd/", fd);
  absl::Status status;
  if (::ftruncate(fd, bytes) != 0) {
    status = ErrnoStatus(absl::StrCat("ftruncate(", name, ", ", bytes, ")"),
                         errno);
  } else if (::fcntl(fd, F_ADD_SEALS,
                     F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    // Fixed size for good: no process can shrink it under a mapping.
    status = ErrnoStatus(absl::StrCat("fcntl(", name, ", F_ADD_SEALS)"), errno);
  }
  absl::StatusOr<uint8_t*> data =
      status.ok() ? MapAtLeast(fd, name, bytes) : status;
  if (!data.ok()) {
    ::close(fd);
    return data.status();
  }
  return SharedMemoryRegion(Kind::kMemfd, *data, bytes, name, fd,
                            /*owner=*/true);
}

absl::StatusOr<SharedMemoryRegion> SharedMemoryRegion::OpenByPath(
    const std::string& path, int64_t bytes, const RegionAccess& access) {
  if (absl::Status s = CheckRequestedSize(path, bytes); !s.ok()) return s;
  if (!IsProcFdPath(path)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared memory path \"", path, "\" is not of the form /proc/<pid>/fd/<n>"));
  }
  if (access.check && access.uid != 0) {
    // A memfd's mode is 0777: what guards it is that only its process (and
    // whoever may ptrace it) can open /proc/<pid>/fd/<n>. ferryd may open
    // any, so it checks that the process is the caller's, and below that
    // the memfd is too; never its own /proc/self.
    const std::string pid_dir = path.substr(0, path.find("/fd/"));
    struct stat proc;
    if (absl::StartsWith(path, "/proc/self/") ||
        ::stat(pid_dir.c_str(), &proc) != 0 || proc.st_uid != access.uid) {
      return absl::PermissionDeniedError(absl::StrCat(
          "shared memory region ", path, ": the process is not one of the "
          "caller's (uid ", access.uid, "), so ferryd does not open its fds"));
    }
  }
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(absl::StrCat("open(", path, ")"), errno);
  if (absl::Status s = CheckOwnedByCaller(
          fd, access, absl::StrCat("shared memory region ", path));
      !s.ok()) {
    ::close(fd);
    return s;
  }
  // F_GET_SEALS works only on shmem-backed files (memfd, tmpfs): a disk
  // file, socket or device behind the fd fails here.
  absl::StatusOr<uint8_t*> data;
  const int seals = ::fcntl(fd, F_GET_SEALS);
  if (seals < 0) {
    data = errno == EINVAL
               ? absl::InvalidArgumentError(absl::StrCat(
                     "shared memory region ", path, " is not a memfd"))
               : ErrnoStatus(absl::StrCat("fcntl(", path, ", F_GET_SEALS)"),
                             errno);
  } else if ((seals & F_SEAL_SHRINK) == 0) {
    data = absl::InvalidArgumentError(absl::StrCat(
        "shared memory region ", path,
        " is not sealed against shrinking (F_SEAL_SHRINK); a shrink would "
        "fault the daemon"));
  } else {
    data = MapAtLeast(fd, path, bytes, access);
  }
  ::close(fd);  // the mapping keeps the pages
  if (!data.ok()) return data.status();
  return SharedMemoryRegion(Kind::kMemfd, *data, bytes, path, -1,
                            /*owner=*/false);
}

absl::StatusOr<SharedMemoryRegion> SharedMemoryRegion::OpenFile(
    const std::string& path, int64_t bytes, const RegionAccess& access) {
  if (absl::Status s = CheckRequestedSize(path, bytes); !s.ok()) return s;
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("file region \"", path, "\" is not an absolute path"));
  }
  if (access.write) {
    return absl::InvalidArgumentError(absl::StrCat(
        "file region ", path, ": a file is registered read-only, as source "
        "memory; a destination's memory is written"));
  }
  // O_NONBLOCK: a FIFO or a device named here must not block the daemon
  // in open(); MapAtLeast then refuses anything but a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK |
                                          O_NOCTTY);
  if (fd < 0) return ErrnoStatus(absl::StrCat("open(", path, ")"), errno);
  // A file the caller could not reach (a directory it may not search)
  // must not be read for it: its own files only.
  if (absl::Status s =
          CheckOwnedByCaller(fd, access, absl::StrCat("file region ", path));
      !s.ok()) {
    ::close(fd);
    return s;
  }
  absl::StatusOr<uint8_t*> data =
      MapAtLeast(fd, path, bytes, access, /*read_only=*/true);
  ::close(fd);  // the mapping keeps the file
  if (!data.ok()) return data.status();
  return SharedMemoryRegion(Kind::kFile, *data, bytes, path, -1,
                            /*owner=*/false);
}

SharedMemoryRegion::SharedMemoryRegion(SharedMemoryRegion&& other) noexcept
    : kind_(other.kind_),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      name_(std::move(other.name_)),
      fd_(std::exchange(other.fd_, -1)),
      owner_(std::exchange(other.owner_, false)),
      unlinked_(other.unlinked_) {}

SharedMemoryRegion& SharedMemoryRegion::operator=(
    SharedMemoryRegion&& other) noexcept {
  if (this != &other) {
    Release();
    kind_ = other.kind_;
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    name_ = std::move(other.name_);
    fd_ = std::exchange(other.fd_, -1);
    owner_ = std::exchange(other.owner_, false);
    unlinked_ = other.unlinked_;
  }
  return *this;
}

SharedMemoryRegion::~SharedMemoryRegion() { Release(); }

absl::Status SharedMemoryRegion::Unlink() {
  if (kind_ != Kind::kNamed || unlinked_ || name_.empty()) {
    return absl::OkStatus();
  }
  if (::shm_unlink(name_.c_str()) != 0) {
    return ErrnoStatus(absl::StrCat("shm_unlink(", name_, ")"), errno);
  }
  unlinked_ = true;
  return absl::OkStatus();
}

void SharedMemoryRegion::Release() {
  // Destructors cannot return a Status; a failure here means a bug (a bad
  // pointer or a name someone else removed), so it is logged, not fatal.
  if (data_ != nullptr && ::munmap(data_, static_cast<size_t>(size_)) != 0) {
    LOG(WARNING) << ErrnoStatus(absl::StrCat("munmap(", name_, ")"), errno);
  }
  data_ = nullptr;
  if (owner_ && kind_ == Kind::kNamed && !unlinked_) {
    if (absl::Status s = Unlink(); !s.ok()) LOG(WARNING) << s;
  }
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  owner_ = false;
}

}  // namespace ferry
