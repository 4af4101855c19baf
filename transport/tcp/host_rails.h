// Rails: the local addresses a daemon's TCP channels to other nodes bind,
// one per NIC (docs/operations.md, "Rails"), from ferryd's --rails.
//
// Threading: a plain function; reads the host's interfaces
// (getifaddrs) each call.
#ifndef FERRY_TRANSPORT_TCP_HOST_RAILS_H_
#define FERRY_TRANSPORT_TCP_HOST_RAILS_H_

#include <cstddef>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace ferry {

// A rail: an address of this host and the interface that holds it (UCX's
// channels name the interface: UCX_NET_DEVICES).
struct Rail {
  std::string address;
  std::string device;
  bool operator==(const Rail& o) const {
    return address == o.address && device == o.device;
  }
};

// The rails `spec` names, addresses of this host, in order:
//   ""      none (one rail: the kernel picks the source address);
//   "auto"  every interface that is up, not loopback, and holds an IPv4
//           address (its first), in interface-name order;
//   else    comma-separated entries, each an address of this host or an
//           interface name (its first IPv4 address, else its first IPv6).
// INVALID_ARGUMENT naming the entry for one that is neither, a duplicate,
// "auto" that finds no interface, or more than `max_rails`.
absl::StatusOr<std::vector<Rail>> ResolveRails(const std::string& spec,
                                               size_t max_rails);

}  // namespace ferry

#endif  // FERRY_TRANSPORT_TCP_HOST_RAILS_H_
