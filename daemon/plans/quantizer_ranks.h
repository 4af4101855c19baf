// BuildStreamPlan's step 3c (plan_cache.h): FP8 in flight's derived
// parameters and quantizer ranks (core/fp8_sources.h) in a stream plan.
#ifndef FERRY_DAEMON_PLANS_QUANTIZER_RANKS_H_
#define FERRY_DAEMON_PLANS_QUANTIZER_RANKS_H_

#include <string>

#include "daemon/plans/plan_cache.h"
#include "transport/device_memory.h"

namespace ferry {

// The instances' quantized targets become derived parameters fed by
// quantizer ranks (one per node that quantizes: this daemon's `node`, or
// a member), which the version's transfers quantize (out->fp8,
// Fp8Quantizer): `out`'s model, sources and those instances' layouts gain
// them. The instances that need them get an error instead when
// AddFp8Sources refuses or their layout does not validate with the
// derived pieces. `devices` (not owned; may be null)
// reads trainer ranks in GPU memory. REQUIRES: out's instances laid out
// (steps 1-3), no source_error.
void AddQuantizerRanks(const std::string& node, DeviceMemory* devices,
                       StreamPlan* out);

}  // namespace ferry

#endif  // FERRY_DAEMON_PLANS_QUANTIZER_RANKS_H_
