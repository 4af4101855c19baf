#include "core/region_copy.h"

#include <cstring>

#if defined(__x86_64__)
#include <emmintrin.h>  // SSE2, part of every x86-64
#endif

namespace ferry {
namespace {

// memcpy whose stores bypass the caches (x86-64; memcpy elsewhere). The
// caller fences (StreamFence) before anyone may read `dst`.
void StreamBytes(uint8_t* dst, const uint8_t* src, size_t n) {
#if defined(__x86_64__)
  // Non-temporal stores need a 16-byte aligned destination: the head up to
  // it, and the tail past the last whole 64-byte line, go through memcpy.
  size_t head = (16 - (reinterpret_cast<uintptr_t>(dst) & 15)) & 15;
  if (head > n) head = n;
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  size_t i = 0;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
#else
  std::memcpy(dst, src, n);
#endif
}

// Orders the non-temporal stores before everything after it (they are
// weakly ordered: without it another thread could see the copy's end
// before its bytes).
void StreamFence() {
#if defined(__x86_64__)
  _mm_sfence();
#endif
}

// A copy with merged dims: `inner_bytes` contiguous on both sides, repeated
// over the outer dims.
struct CoalescedCopy {
  Dims extent;  // outer dims, units
  Dims src_strides;
  Dims dst_strides;
  int64_t inner_bytes = 0;
};

CoalescedCopy Coalesce(const Dims& src_strides, const Dims& dst_strides,
                       const Dims& extent, int64_t unit_bytes) {
  CoalescedCopy c;
  // Drop unit dims: they add no iterations and would block merging.
  Dims e, s, d;
  for (size_t i = 0; i < extent.size(); ++i) {
    if (extent[i] == 1) continue;
    e.push_back(extent[i]);
    s.push_back(src_strides[i]);
    d.push_back(dst_strides[i]);
  }
  // Fold the innermost dims into one contiguous run while both sides are
  // contiguous across them.
  int64_t run_units = 1;
  while (!e.empty() && s.back() == run_units && d.back() == run_units) {
    run_units *= e.back();
    e.pop_back();
    s.pop_back();
    d.pop_back();
  }
  c.inner_bytes = run_units * unit_bytes;
  // Merge adjacent outer dims that step uniformly on both sides.
  for (size_t i = 0; i < e.size(); ++i) {
    if (!c.extent.empty() &&
        c.src_strides.back() == s[i] * e[i] &&
        c.dst_strides.back() == d[i] * e[i]) {
      c.extent.back() *= e[i];
      c.src_strides.back() = s[i];
      c.dst_strides.back() = d[i];
    } else {
      c.extent.push_back(e[i]);
      c.src_strides.push_back(s[i]);
      c.dst_strides.push_back(d[i]);
    }
  }
  return c;
}

}  // namespace

void CopyStrided(const uint8_t* src, const Dims& src_strides, uint8_t* dst,
                 const Dims& dst_strides, const Dims& extent,
                 int64_t unit_bytes, StoreHint hint) {
  for (int64_t e : extent) {
    if (e == 0) return;
  }
  const CoalescedCopy c =
      Coalesce(src_strides, dst_strides, extent, unit_bytes);
  const size_t run = static_cast<size_t>(c.inner_bytes);
  const bool stream =
      hint == StoreHint::kStreaming && c.inner_bytes >= kStreamingMinRun;
  auto copy_run = [run, stream](uint8_t* d, const uint8_t* s) {
    if (stream) {
      StreamBytes(d, s, run);
    } else {
      std::memcpy(d, s, run);
    }
  };
  const size_t n = c.extent.size();
  if (n == 0) {
    copy_run(dst, src);
    if (stream) StreamFence();
    return;
  }
  // Odometer over the outer dims.
  Dims index(n, 0);
  const uint8_t* s = src;
  uint8_t* d = dst;
  while (true) {
    copy_run(d, s);
    size_t k = n;
    while (k-- > 0) {
      if (++index[k] < c.extent[k]) {
        s += c.src_strides[k] * unit_bytes;
        d += c.dst_strides[k] * unit_bytes;
        break;
      }
      s -= (c.extent[k] - 1) * c.src_strides[k] * unit_bytes;
      d -= (c.extent[k] - 1) * c.dst_strides[k] * unit_bytes;
      index[k] = 0;
      if (k == 0) {
        if (stream) StreamFence();
        return;
      }
    }
  }
}

int64_t BoxBytes(const Box& box, DType dtype) {
  // Elements / block elements: exact, as boxes are block-aligned.
  return Volume(box.extent) / BlockElems(dtype) * UnitBytes(dtype);
}

void CopyBoxBetweenPieces(const uint8_t* src_buffer, const Piece& src,
                          uint8_t* dst_buffer, const Piece& dst,
                          const Box& box, DType dtype) {
  CopyStrided(src_buffer + ByteOffsetOf(src, box, dtype), src.strides,
              dst_buffer + ByteOffsetOf(dst, box, dtype), dst.strides,
              StorageBox(box, dtype).extent, UnitBytes(dtype));
}

int64_t PackBox(const uint8_t* buffer, const Piece& piece, const Box& box,
                DType dtype, uint8_t* out) {
  const Dims units = StorageBox(box, dtype).extent;
  CopyStrided(buffer + ByteOffsetOf(piece, box, dtype), piece.strides, out,
              RowMajorStrides(units), units, UnitBytes(dtype));
  return Volume(units) * UnitBytes(dtype);
}

int64_t UnpackBox(const uint8_t* in, uint8_t* buffer, const Piece& piece,
                  const Box& box, DType dtype) {
  const Dims units = StorageBox(box, dtype).extent;
  CopyStrided(in, RowMajorStrides(units),
              buffer + ByteOffsetOf(piece, box, dtype), piece.strides, units,
              UnitBytes(dtype));
  return Volume(units) * UnitBytes(dtype);
}

}  // namespace ferry
