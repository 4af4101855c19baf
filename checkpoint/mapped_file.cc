#include "checkpoint/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace ferry {

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::Open(
    const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    const std::string what = absl::StrCat(path, ": cannot open: ", std::strerror(e));
    if (e == ENOENT) return absl::NotFoundError(what);
    if (e == EACCES) return absl::PermissionDeniedError(what);
    return absl::InvalidArgumentError(what);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": not a regular file"));
  }
  const int64_t size = st.st_size;
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED,
                     fd, 0);
    if (p == MAP_FAILED) {
      const int e = errno;
      ::close(fd);
      return absl::ResourceExhaustedError(
          absl::StrCat(path, ": cannot map ", size, " bytes: ", std::strerror(e)));
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file
  return std::shared_ptr<const MappedFile>(new MappedFile(path, data, size));
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) {
    ::munmap(const_cast<uint8_t*>(data_), static_cast<size_t>(size_));
  }
}

}  // namespace ferry
