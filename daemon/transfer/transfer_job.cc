#include "daemon/transfer/transfer_job.h"

namespace ferry {

BufferPlace RankMemory::Find(uint32_t buffer) const {
  BufferPlace place;
  if (buffer & kStagingBufferBit) {
    const uint32_t k = buffer & ~kStagingBufferBit;
    if (k < staging_bases.size()) place.base = staging_bases[k];
    place.pinned = staging != nullptr && staging->pinned();
    place.gpu = staging != nullptr ? staging->gpu() : -1;
    return place;
  }
  if (client == nullptr) return place;
  return PlaceIn(*client, buffer);
}

int64_t JobBytes(const TransferJob& job) {
  const PlannedInstance& inst = job.plan->instances[job.instance];
  return job.plan->plan.instances[inst.plan_index].bytes;
}

}  // namespace ferry
