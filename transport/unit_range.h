// Copying part of a box: the units [begin, end) of a box in row-major order.
//
// The host transports cut work into pieces of bounded size: the local copy
// engine so that worker threads share one large box, tcp so that each piece
// is packed, checksummed and unpacked while it is still in cache. A row-major
// unit range of a box is a few sub-boxes (at most 2 * rank - 1, see
// FlatRangeToBoxes), each copied with core's CopyStrided, which does one
// memcpy per contiguous run.
#ifndef FERRY_TRANSPORT_UNIT_RANGE_H_
#define FERRY_TRANSPORT_UNIT_RANGE_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/geometry.h"
#include "core/region_copy.h"
#include "transport/transport.h"

namespace ferry {

// Checks one side of a box copy: rank of strides equals rank of extent,
// extents >= 0, unit_bytes > 0, the byte size fits in int64 and a non-empty
// box has a base. Sets *bytes to the box's byte size. `what` names the box
// in the error ("bucket 7 box 3").
absl::Status ValidateRegionBox(const RegionView& region, const Dims& extent,
                               int64_t unit_bytes, absl::string_view what,
                               int64_t* bytes);

// True when the box occupies one contiguous run in row-major order (dims of
// extent 1 do not count), so a range of it is a single span of memory.
bool IsRowMajorContiguous(const Dims& extent, const Dims& strides);

// Copies units [begin, end) of a box of `extent` from `src` to `dst` (both
// RegionViews of the box's first unit). REQUIRES: 0 <= begin <= end <=
// Volume(extent); regions valid.
// `hint`: core/region_copy.h's StoreHint.
void CopyUnitRange(const RegionView& src, const RegionView& dst,
                   const Dims& extent, int64_t unit_bytes, int64_t begin,
                   int64_t end, StoreHint hint = StoreHint::kCached);

// Copies units [begin, end) of a box between its region and `packed`, which
// holds exactly those units, row-major and contiguous.
void PackUnitRange(const RegionView& src, const Dims& extent,
                   int64_t unit_bytes, int64_t begin, int64_t end,
                   uint8_t* packed);
void UnpackUnitRange(const uint8_t* packed, const RegionView& dst,
                     const Dims& extent, int64_t unit_bytes, int64_t begin,
                     int64_t end);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_UNIT_RANGE_H_
