// Client-side checks of the names the wire API constrains (docs/api.md,
// "Names"): streams, instance ids and node names are 1 to 128 characters of
// [A-Za-z0-9._-]. Checked before any RPC so a typo fails with a message
// that names the field, not with a round trip.
#ifndef FERRY_CLIENT_NAMES_H_
#define FERRY_CLIENT_NAMES_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace ferry {

// INVALID_ARGUMENT "<field> '<value>' ..." when `value` is not a valid name.
absl::Status ValidateName(absl::string_view field, absl::string_view value);

}  // namespace ferry

#endif  // FERRY_CLIENT_NAMES_H_
