#include "daemon/participant.h"

#include "absl/strings/str_cat.h"

namespace ferry {

std::string Participant::Describe() const {
  if (role == Role::kSource) {
    return absl::StrCat("source ", stream, " rank ", rank);
  }
  return absl::StrCat("instance ", instance_id, " tp rank ", tp_rank);
}

}  // namespace ferry
