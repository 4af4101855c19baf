// Small arithmetic shared by the synthetic trainer and engine layouts: how a
// dimension splits across ranks, and how a rank packs its local tensors
// into one buffer.
#ifndef FERRY_CORE_MODELS_LAYOUT_MATH_H_
#define FERRY_CORE_MODELS_LAYOUT_MATH_H_

#include <algorithm>
#include <cstdint>

namespace ferry {

// Local tensors start on 256-byte boundaries, as CUDA allocators align
// them; copy kernels then see aligned starts.
constexpr int64_t kTensorAlignment = 256;

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t RoundUp(int64_t a, int64_t b) { return CeilDiv(a, b) * b; }

struct Range {
  int64_t begin = 0;
  int64_t end = 0;
  int64_t size() const { return end - begin; }
};

// Part `index` of `parts` of [0, size), in whole granules (the last granule
// may be short when size is not a multiple): the first size%parts parts get
// one granule more (ceil), the rest floor. REQUIRES: parts >= 1, granule >= 1.
inline Range SplitRange(int64_t size, int64_t parts, int64_t index,
                        int64_t granule = 1) {
  const int64_t units = CeilDiv(size, granule);
  const int64_t base = units / parts, extra = units % parts;
  const int64_t first = index * base + std::min(index, extra);
  const int64_t count = base + (index < extra ? 1 : 0);
  return Range{std::min(first * granule, size),
               std::min((first + count) * granule, size)};
}

// Places a rank's local tensors one after another in its buffer 0.
class BufferPacker {
 public:
  // Returns the byte offset of a new tensor of `bytes` bytes.
  int64_t Place(int64_t bytes) {
    const int64_t offset = RoundUp(end_, kTensorAlignment);
    end_ = offset + bytes;
    return offset;
  }
  // The buffer size that holds every placed tensor.
  int64_t size() const { return RoundUp(end_, kTensorAlignment); }

 private:
  int64_t end_ = 0;
};

}  // namespace ferry

#endif  // FERRY_CORE_MODELS_LAYOUT_MATH_H_
