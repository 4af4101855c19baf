// 64-bit arithmetic that reports overflow instead of wrapping. Every size a
// client sends (shapes, offsets, strides) goes through these before it is
// used to compute an address, so a hostile shape cannot overflow.
#ifndef FERRY_CORE_CHECKED_MATH_H_
#define FERRY_CORE_CHECKED_MATH_H_

#include <cstdint>

namespace ferry {

// Each returns false (and leaves *out unspecified) on overflow.
inline bool CheckedAdd(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_add_overflow(a, b, out);
}
inline bool CheckedMul(int64_t a, int64_t b, int64_t* out) {
  return !__builtin_mul_overflow(a, b, out);
}

}  // namespace ferry

#endif  // FERRY_CORE_CHECKED_MATH_H_
