// Rails: a route between two nodes striped over several channels, one per
// rail pair (docs/operations.md, "Rails"; docs/architecture.md).
//
// Which channel carries which bucket is a function of the buckets' sizes
// alone (StripeOverRails), so the sender and the receiver compute the
// same assignment from the buckets they both hold in wire order, and
// nothing about it travels. Each channel carries its share in wire order;
// the channels run at once, so the order between channels is free.
//
// Threading: SendStriped and ReceiveStriped run one thread per channel
// beyond the first (the caller's thread takes the first); each channel is
// used by that one thread, as transport.h asks. They return when every
// thread has.
#ifndef FERRY_DAEMON_TRANSFER_RAIL_STRIPE_H_
#define FERRY_DAEMON_TRANSFER_RAIL_STRIPE_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "transport/transport.h"

namespace ferry {

// The buckets (indices into `views`) each of `rails` channels carries, in
// wire order. Largest bucket first onto the least-loaded channel (ties:
// the earlier bucket, the lower channel), which keeps the channels' bytes
// within one bucket of each other. `rails` >= 1.
std::vector<std::vector<size_t>> StripeOverRails(
    const std::vector<BucketView>& views, size_t rails);

// Moves bucket i of `views` on `channel` (a Send, a Receive, or a codec's
// several: delta_routes.h).
using MoveBucket = std::function<absl::Status(Channel& channel, size_t i)>;

// Runs each rail's share of `views` over `channels` (StripeOverRails),
// `move` per bucket, then `finish` per channel if given (a Flush); counts
// the buckets moved whole in `on_bytes` (if given) and *moved_bytes.
// Failures as SendStriped's.
absl::Status RunStriped(const std::vector<Channel*>& channels,
                        const std::vector<BucketView>& views,
                        const std::function<bool()>& cancelled,
                        const MoveBucket& move,
                        const std::function<absl::Status(Channel&)>& finish,
                        const std::function<void(int64_t)>& on_bytes,
                        int64_t* moved_bytes);

// Sends `views` over `channels` as StripeOverRails says, then flushes each.
// `on_bytes` is called (from any of the threads) as buckets go out, and
// *sent_bytes ends as their sum. The first failure stops the other
// channels at their next bucket and is returned, naming the rail when
// there are several; `cancelled` stops them all (CANCELLED).
absl::Status SendStriped(const std::vector<Channel*>& channels,
                         const std::vector<BucketView>& views,
                         absl::Time deadline,
                         const std::function<bool()>& cancelled,
                         const std::function<void(int64_t)>& on_bytes,
                         int64_t* sent_bytes);

// Receives `views` from `channels`, the same assignment. *received_bytes
// counts the buckets that landed whole. Failures as SendStriped's.
absl::Status ReceiveStriped(const std::vector<Channel*>& channels,
                            const std::vector<BucketView>& views,
                            absl::Time deadline,
                            const std::function<bool()>& cancelled,
                            int64_t* received_bytes);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_RAIL_STRIPE_H_
