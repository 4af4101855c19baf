// The local backend: same-node host copies, one copy per byte.
//
// The daemon maps the source rank's and the destination rank's shared memory
// and copies each box straight from one into the other (design §4, "same
// node, host"). One core's memcpy rarely saturates memory bandwidth, so the
// engine spreads a batch over a small pool of threads: large boxes are cut
// along their outer dims (row-major unit ranges) so that workers share them,
// small ones are grouped, and each piece is one memcpy per contiguous run
// (core's CopyStrided).
//
// Threading: thread-safe; concurrent Run calls share the pool. The calling
// thread copies too, so a Run never waits on an idle pool.
#ifndef FERRY_TRANSPORT_LOCAL_LOCAL_COPY_ENGINE_H_
#define FERRY_TRANSPORT_LOCAL_LOCAL_COPY_ENGINE_H_

#include <memory>

#include "transport/transport.h"

namespace ferry {

// `threads` is how many threads copy during a Run, the caller's included
// (so threads - 1 workers are started); <= 0 means min(4, cores). Always
// viable: plain host memory.
std::unique_ptr<CopyEngine> CreateLocalCopyEngine(int threads = 0);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_LOCAL_LOCAL_COPY_ENGINE_H_
