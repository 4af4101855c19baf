// Moving the bytes of one box between two strided host regions.
//
// This is the host data path's only inner loop: a same-node transfer copies
// a box from a source rank's mapped buffer straight into a destination
// rank's, and a cross-node transfer packs boxes into a contiguous bucket and
// unpacks them on arrival. Dimensions that are contiguous on both sides are
// merged first, so a row shard becomes one memcpy per row (or one memcpy in
// all), not one per element.
#ifndef FERRY_CORE_REGION_COPY_H_
#define FERRY_CORE_REGION_COPY_H_

#include <cstdint>

#include "core/piece.h"

namespace ferry {

// How a copy writes its destination. kCached: through the caches (plain
// memcpy). kStreaming: around them, with non-temporal stores, for a copy
// far larger than the caches whose destination no one reads soon (a
// same-node update's weights): a cached store first reads each
// destination line it does not own, so a copy that cannot stay in cache
// moves three bytes for every two it needs, and a large copy cut into
// slices does not reach glibc's own non-temporal threshold. On x86-64;
// elsewhere both are memcpy. Runs shorter than kStreamingMinRun are
// copied cached either way (measured on the development VM:
// docs/benchmarks.md, "Streaming stores").
enum class StoreHint { kCached, kStreaming };
inline constexpr int64_t kStreamingMinRun = 2 << 10;

// Copies a box of `extent` storage units. `src`/`dst` point at the box's
// first unit; strides are in units. REQUIRES: ranks equal, regions valid.
// With kStreaming, the stores are complete (fenced) when it returns.
void CopyStrided(const uint8_t* src, const Dims& src_strides, uint8_t* dst,
                 const Dims& dst_strides, const Dims& extent,
                 int64_t unit_bytes, StoreHint hint = StoreHint::kCached);

// Copies box `box` (elements, inside both pieces) from the buffer holding
// `src` to the buffer holding `dst`. Buffers are the bases of the pieces'
// buffers.
void CopyBoxBetweenPieces(const uint8_t* src_buffer, const Piece& src,
                          uint8_t* dst_buffer, const Piece& dst,
                          const Box& box, DType dtype);

// Packs box `box` of `piece` into `out` (contiguous, row-major), returning
// the bytes written; Unpack is the inverse.
int64_t PackBox(const uint8_t* buffer, const Piece& piece, const Box& box,
                DType dtype, uint8_t* out);
int64_t UnpackBox(const uint8_t* in, uint8_t* buffer, const Piece& piece,
                  const Box& box, DType dtype);

// Bytes a box of `dtype` occupies. REQUIRES: block-aligned.
int64_t BoxBytes(const Box& box, DType dtype);

}  // namespace ferry

#endif  // FERRY_CORE_REGION_COPY_H_
