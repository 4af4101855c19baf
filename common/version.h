// ferry's release version: ferryd reports it (GetHealth.daemon_version,
// --version), and a member daemon joins only a coordinator of the same one
// (the Peer protocol has no version negotiation).
#ifndef FERRY_COMMON_VERSION_H_
#define FERRY_COMMON_VERSION_H_

namespace ferry {

constexpr const char* kDaemonVersion = "0.1.0";

}  // namespace ferry

#endif  // FERRY_COMMON_VERSION_H_
