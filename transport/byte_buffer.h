// A byte buffer without value-initialization, for the channels' staging:
// it is overwritten before it is read, and zeroing 64 MiB per bucket
// would cost a pass over memory.
#ifndef FERRY_TRANSPORT_BYTE_BUFFER_H_
#define FERRY_TRANSPORT_BYTE_BUFFER_H_

#include <cstdint>
#include <memory>
#include <new>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ferry {

struct ByteBuffer {
  std::unique_ptr<uint8_t[]> data;
  int64_t capacity = 0;

  // Grows to at least `bytes` (contents not kept). RESOURCE_EXHAUSTED
  // naming `what` instead of std::bad_alloc: no exceptions here.
  absl::Status Reserve(int64_t bytes, absl::string_view what) {
    if (bytes <= capacity) return absl::OkStatus();
    data.reset(new (std::nothrow) uint8_t[static_cast<size_t>(bytes)]);
    if (data == nullptr) {
      capacity = 0;
      return absl::ResourceExhaustedError(
          absl::StrCat(what, ": cannot allocate ", bytes, " bytes of staging"));
    }
    capacity = bytes;
    return absl::OkStatus();
  }
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_BYTE_BUFFER_H_
