#include "core/fp8_targets.h"

#include "absl/strings/str_cat.h"

namespace ferry {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

}  // namespace

bool IsFp8Source(DType dtype) {
  return dtype == DType::kBF16 || dtype == DType::kF16 ||
         dtype == DType::kF32;
}

bool IsFp8Format(DType dtype) {
  return dtype == DType::kF8E4M3 || dtype == DType::kF8E5M2;
}

Dims Fp8ScaleShape(const Dims& local_shape, int64_t block_rows,
                   int64_t block_cols) {
  Dims out = local_shape;
  const size_t n = out.size();
  if (n < 2) return out;
  out[n - 2] = CeilDiv(out[n - 2], block_rows);
  out[n - 1] = CeilDiv(out[n - 1], block_cols);
  return out;
}

Box QuantizedTarget::ScaleBox() const {
  Box out = box;
  const size_t n = out.rank();
  if (n < 2) return out;
  const int64_t blocks[2] = {block_rows, block_cols};
  for (size_t k = 0; k < 2; ++k) {
    const size_t d = n - 2 + k;
    const int64_t first = box.offset[d] / blocks[k];
    const int64_t end = CeilDiv(box.offset[d] + box.extent[d], blocks[k]);
    out.offset[d] = first;
    out.extent[d] = end - first;
  }
  return out;
}

std::string Fp8BlockCut(const Box& box, const Dims& shape,
                        const Dims& local_offset, const Dims& local_shape,
                        int64_t block_rows, int64_t block_cols) {
  const size_t n = box.rank();
  const size_t ln = local_shape.size();
  if (n < 2 || ln < n || local_offset.size() != ln || shape.size() != n) {
    return absl::StrCat("FP8 blocks need at least two dims; box ",
                        BoxToString(box), " in a live tensor of ",
                        DimsToString(local_shape));
  }
  const int64_t blocks[2] = {block_rows, block_cols};
  const char* words[2] = {"rows", "columns"};
  for (size_t k = 0; k < 2; ++k) {
    const size_t d = n - 2 + k;       // in the checkpoint tensor
    const size_t ld = ln - 2 + k;     // in the live tensor
    const int64_t b = blocks[k];
    const int64_t start = box.offset[d];
    const int64_t end = start + box.extent[d];
    const int64_t live_start = local_offset[ld];
    const int64_t live_end = live_start + box.extent[d];
    const bool cuts = start % b != 0 || live_start % b != 0 ||
                      (end % b != 0 && end != shape[d]) ||
                      (live_end % b != 0 && live_end != local_shape[ld]);
    if (cuts) {
      return absl::StrCat("its ", words[k], " ", start, ":", end, " (of ",
                          shape[d], ") at live ", words[k], " ", live_start,
                          ":", live_end, " (of ", local_shape[ld], ") cut ",
                          block_rows, "x", block_cols,
                          " blocks: a block would hold elements of two "
                          "shards or two tensors");
    }
  }
  return "";
}

}  // namespace ferry
