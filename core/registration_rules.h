// Registration rules: what a rank's place in its group must be, the same
// for the client libraries (which check before sending) and the daemon
// (which checks what arrives). One definition, so the two never disagree
// and a user sees the same message from either.
//
// Pure; any thread.
#ifndef FERRY_CORE_REGISTRATION_RULES_H_
#define FERRY_CORE_REGISTRATION_RULES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ferry {

// A group of `size` ranks (a trainer's world_size, an instance's tp_size)
// and one rank of it: INVALID_ARGUMENT "<who>: <size_name> 0 must be >= 1"
// or "<who>: <rank_name> 5 is outside [0, 4)".
absl::Status CheckRankInGroup(absl::string_view who,
                              absl::string_view rank_name, int64_t rank,
                              absl::string_view size_name, int64_t size);

}  // namespace ferry

#endif  // FERRY_CORE_REGISTRATION_RULES_H_
