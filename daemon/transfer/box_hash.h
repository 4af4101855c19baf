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
// HashLocal hashes a set of such boxes in memory mapped here, on several
// threads for large sets, each run of boxes guarded against a client that
// shrank its memory (transport/memory_fault_guard.h): the two checksum
// passes of transfer_checksums.h and Peer.HashBoxes use it.
//
// Threading: pure functions on host memory; callers hash different boxes
// on different threads.
#ifndef FERRY_DAEMON_TRANSFER_BOX_HASH_H_
#define FERRY_DAEMON_TRANSFER_BOX_HASH_H_

#include <atomic>
#include <cstdint>
#include <vector>

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

// One box to hash in memory mapped here.
struct LocalBox {
  const uint8_t* base;
  const Dims* strides;
  Dims extent;
  int64_t unit_bytes;
  int64_t bytes;
};

// Why a box was not hashed: its memory was shrunk under the mapping.
inline constexpr char kUnbackedReason[] =
    "not verified: the shared memory is no longer backed (shrunk after "
    "registration)";

// Hashing threads when none are configured: the cores, 1 to 4.
int DefaultHashThreads();

// Hashes every box (`threads` <= 0: DefaultHashThreads; sets under 8 MiB
// on the calling thread); with `cancel` set, stops early (the hashes are
// then not used). A box whose client shrank its memory (SIGBUS) gets
// faulted[i] = 1 instead of a hash, and the daemon carries on.
void HashLocal(const std::vector<LocalBox>& boxes, int threads,
               std::vector<uint64_t>* out, std::vector<char>* faulted,
               const std::atomic<bool>* cancel = nullptr);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_BOX_HASH_H_
