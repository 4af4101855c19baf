// Donor plans: how an instance is filled from another instance of its stream
// that already holds the version (a bootstrap of a late instance,
// ReloadInPlace), never from the trainer, whose memory has moved on.
//
// The donor's ranks take the place of the stream's sources: its resolved
// layout (direct pieces in its live buffers, in the model's indices) is a
// source layout like a trainer rank's, so the planner reshards from it to
// any TP size and fusion of the target, and the executors run the plan
// unchanged. A donor serves only what it holds in its own buffers: an
// instance that receives some tensors through fallback staging (the engine's
// loader transforms them) cannot be a donor. A donor that holds only some
// of the stream's parameters (an FP8 instance: the quantized tensors, not
// the trainer's bf16) serves a target that needs only those: the plan's
// model is narrowed to them, renumbered.
//
// Pure; any thread. The plan shares the stream plan's participants.
#ifndef FERRY_DAEMON_PLANS_DONOR_PLAN_H_
#define FERRY_DAEMON_PLANS_DONOR_PLAN_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/plans/plan_cache.h"

namespace ferry {

// Why the instance at `donor` (index into sp.instances) cannot serve as a
// donor of sp's model, or "" when it can: planned without error and every
// byte of every parameter in its buffers, none in staging.
std::string DonorUnfitReason(const StreamPlan& sp, int32_t donor);

// A plan that fills sp.instances[target] from sp.instances[donor]: its
// `sources` are the donor's ranks (by tp rank), its one instance the
// target (plan_index 0), no relays. FAILED_PRECONDITION with
// DonorUnfitReason when the donor cannot serve; INVALID_ARGUMENT when the
// target cannot be planned (its own error).
absl::StatusOr<std::shared_ptr<const StreamPlan>> BuildDonorPlan(
    const StreamPlan& sp, int32_t donor, int32_t target);

}  // namespace ferry

#endif  // FERRY_DAEMON_PLANS_DONOR_PLAN_H_
