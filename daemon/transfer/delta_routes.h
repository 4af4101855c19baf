// Delta versions on a route (docs/architecture.md, "Delta versions"): a
// route whose RunTransferRequest says `delta` sends each bucket as a
// 16-byte form bucket (dense, or a patch and its size) followed by the
// bucket itself or its patch (transport/bucket_patch.h), both as ordinary
// buckets on the route's channel, so every channel kind carries them and
// checksums them.
//
// A bucket goes as a patch only where that is exact and pays: the route's
// destination holds version `base` (the coordinator says so: it committed
// that version and has not been written since), every box's source
// buffer's shadow changed from exactly `base` (delta_shadows.h), every box
// is patchable (2-byte units; no staging), and the patch is smaller than
// the bucket. Otherwise dense. Either way the sender's shadows move to the
// route's version.
//
// Threading: DeltaSender::Send and ReceiveDelta may run on several rails'
// threads at once (each on its own channel); the counts are atomic.
#ifndef FERRY_DAEMON_TRANSFER_DELTA_ROUTES_H_
#define FERRY_DAEMON_TRANSFER_DELTA_ROUTES_H_

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/transfer/copy_router.h"
#include "daemon/transfer/delta_shadows.h"
#include "proto/ferry/v1/peer.pb.h"
#include "transport/transport.h"

namespace ferry {

// What a route's delta buckets came to (both ends count their own).
struct DeltaCounts {
  std::atomic<int64_t> dense_bytes{0};    // buckets sent as they are
  std::atomic<int64_t> patched_bytes{0};  // buckets sent as patches
  std::atomic<int64_t> patch_bytes{0};    // those patches on the wire
  std::atomic<int64_t> changed_bytes{0};  // chunks the patches changed

  // One bucket of `bucket_bytes` that went as a patch of `patch` bytes
  // changing `changed_chunks` chunks.
  void Patched(int64_t bucket_bytes, int64_t patch, int64_t changed_chunks);
  void AddTo(v1::RunTransferResponse* response) const;
};

class DeltaSender {
 public:
  // `views` and `places` (by bucket, by box: the sources' buffers) of a
  // route whose receiver's part is `receiver` (its version, its
  // delta_base: the version the destination holds, 0: none, every bucket
  // dense; a bucket with a box landing in staging is dense too). Not
  // owned: all must outlive it.
  DeltaSender(DeltaShadows* shadows, const v1::RunTransferRequest& receiver,
              const std::vector<BucketView>& views,
              const std::vector<std::vector<BufferPlace>>& places,
              DeltaCounts* counts);

  // Sends bucket i (its form, then it or its patch) on `channel`.
  absl::Status Send(Channel& channel, size_t i, absl::Time deadline) const;

 private:
  DeltaShadows* const shadows_;
  const v1::RunTransferRequest& receiver_;
  const int64_t version_, base_;
  const std::vector<BucketView>& views_;
  const std::vector<std::vector<BufferPlace>>& places_;
  DeltaCounts* const counts_;
};

// Receives bucket `view` (its form, then it or its patch) from `channel`
// into the destination; `what` names the route in errors. DATA_LOSS for a
// form or patch that does not fit the bucket.
absl::Status ReceiveDelta(Channel& channel, const BucketView& view,
                          absl::Time deadline, DeltaCounts* counts,
                          const std::string& what);

}  // namespace ferry

#endif  // FERRY_DAEMON_TRANSFER_DELTA_ROUTES_H_
