// BoxHash: a 64-bit checksum of the bytes of one strided box, for the
// on-demand integrity check (daemon/transfer/transfer_checksums.h).
//
// The hash is XXH3-64 (Debian's libxxhash) of the box's bytes in row-major
// order of its storage units, whatever the strides: a box hashed where it
// left a source rank and the same box hashed where it landed in a
// destination rank give the same value exactly when the bytes are equal,
// even though the two sides lay it out differently. Contiguous dims are
// merged first, so a row shard is one XXH3 update per row (or one call in
// all), as core's CopyStrided does one memcpy per contiguous run.
//
// Threading: pure functions on host memory; callers hash different boxes
// on different threads.
#ifndef FERRY_DAEMON_TRANSFER_BOX_HASH_H_
#define FERRY_DAEMON_TRANSFER_BOX_HASH_H_

#include <cstdint>

#include "core/geometry.h"

namespace ferry {

// XXH3-64 of a box of `extent` storage units whose first unit is at `base`
// (host memory), with `strides` in units. REQUIRES: ranks equal, the box
// inside mapped memory. An empty box hashes as zero bytes.
uint64_t HashBox(const uint8_t* base, const Dims& strides, const Dims& extent,
                 int64_t unit_bytes);

// XXH3-64 of `bytes` contiguous bytes (the same value HashBox gives for a
// contiguous box holding them).
uint64_t HashBytes(const uint8_t* data, int64_t bytes);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_BOX_HASH_H_
