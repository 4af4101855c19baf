// Test oracle for data movement: the bytes every parameter should hold, and
// a deliberately naive element-by-element reader/writer of pieces that
// shares no code with core/region_copy (so a bug there cannot hide itself).
#ifndef FERRY_TESTS_CORE_ORACLE_H_
#define FERRY_TESTS_CORE_ORACLE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "core/piece.h"

namespace ferry {
namespace testing {

// The byte at `byte_in_unit` of storage unit `unit` (row-major flat index)
// of parameter `param`, for version `version`.
inline uint8_t OracleByte(int32_t param, int64_t unit, int64_t byte_in_unit,
                          uint64_t version = 0) {
  uint64_t x = (static_cast<uint64_t>(param) << 40) ^
               (static_cast<uint64_t>(unit) * 0x9E3779B97F4A7C15ull) ^
               (static_cast<uint64_t>(byte_in_unit) << 56) ^
               (version * 0xD1B54A32D192ED03ull);
  x ^= x >> 31;
  x *= 0xBF58476D1CE4E5B9ull;
  x ^= x >> 29;
  return static_cast<uint8_t>(x);
}

// Visits every storage unit of `piece` (its whole box): `fn(global flat unit
// index, byte address of the unit in the buffer)`.
inline void ForEachUnit(const ParamSpec& spec, const Piece& piece,
                        const std::function<void(int64_t, int64_t)>& fn) {
  const int64_t block = BlockElems(spec.dtype);
  const size_t n = piece.box.rank();
  Dims gshape = spec.shape, off = piece.box.offset, ext = piece.box.extent;
  if (n > 0) {
    gshape.back() /= block;
    off.back() /= block;
    ext.back() /= block;
  }
  for (int64_t e : ext) {
    if (e == 0) return;
  }
  Dims idx(n, 0);
  while (true) {
    int64_t flat = 0, local = 0;
    for (size_t i = 0; i < n; ++i) {
      flat = flat * gshape[i] + off[i] + idx[i];
      local += idx[i] * piece.strides[i];
    }
    fn(flat, piece.byte_offset + local * UnitBytes(spec.dtype));
    size_t k = n;
    while (k > 0) {
      --k;
      if (++idx[k] < ext[k]) break;
      idx[k] = 0;
      if (k == 0) return;
    }
    if (n == 0) return;
  }
}

// Writes the oracle bytes of `piece` into `buffer`.
inline void FillPiece(const ParamSpec& spec, int32_t param, const Piece& piece,
                      uint8_t* buffer, uint64_t version = 0) {
  const int64_t ub = UnitBytes(spec.dtype);
  ForEachUnit(spec, piece, [&](int64_t unit, int64_t addr) {
    for (int64_t b = 0; b < ub; ++b) {
      buffer[addr + b] = OracleByte(param, unit, b, version);
    }
  });
}

// Counts the bytes of `piece` in `buffer` that differ from the oracle.
inline int64_t CountWrongBytes(const ParamSpec& spec, int32_t param,
                               const Piece& piece, const uint8_t* buffer,
                               uint64_t version = 0) {
  const int64_t ub = UnitBytes(spec.dtype);
  int64_t wrong = 0;
  ForEachUnit(spec, piece, [&](int64_t unit, int64_t addr) {
    for (int64_t b = 0; b < ub; ++b) {
      if (buffer[addr + b] != OracleByte(param, unit, b, version)) ++wrong;
    }
  });
  return wrong;
}

}  // namespace testing
}  // namespace ferry

#endif  // FERRY_TESTS_CORE_ORACLE_H_
