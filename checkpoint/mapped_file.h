// MappedFile: a file mapped read-only (MAP_SHARED, PROT_READ), the whole of
// it, for as long as the object lives. Checkpoint readers parse headers
// straight from the mapping and tensors are read where they lie.
#ifndef FERRY_CHECKPOINT_MAPPED_FILE_H_
#define FERRY_CHECKPOINT_MAPPED_FILE_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace ferry {

class MappedFile {
 public:
  // NOT_FOUND (no such file), PERMISSION_DENIED, INVALID_ARGUMENT (not a
  // regular file), each naming the path.
  static absl::StatusOr<std::shared_ptr<const MappedFile>> Open(
      const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  MappedFile(std::string path, const uint8_t* data, int64_t size)
      : path_(std::move(path)), data_(data), size_(size) {}
  const std::string path_;
  const uint8_t* const data_;  // null for an empty file
  const int64_t size_;
};

}  // namespace ferry

#endif  // FERRY_CHECKPOINT_MAPPED_FILE_H_
