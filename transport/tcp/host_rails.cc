#include "transport/tcp/host_rails.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>

#include <algorithm>
#include <cerrno>
#include <map>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "transport/os_error.h"

namespace ferry {
namespace {

struct Interface {
  bool up = false;
  bool loopback = false;
  std::vector<std::string> v4, v6;  // in the order getifaddrs lists them
};

absl::StatusOr<std::map<std::string, Interface>> HostInterfaces() {
  struct ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return ErrnoStatus("getifaddrs", errno);
  std::map<std::string, Interface> out;
  for (struct ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    Interface& i = out[a->ifa_name];
    i.up = (a->ifa_flags & IFF_UP) != 0;
    i.loopback = (a->ifa_flags & IFF_LOOPBACK) != 0;
    if (a->ifa_addr == nullptr) continue;
    char text[INET6_ADDRSTRLEN] = {0};
    if (a->ifa_addr->sa_family == AF_INET) {
      ::inet_ntop(AF_INET,
                  &reinterpret_cast<struct sockaddr_in*>(a->ifa_addr)->sin_addr,
                  text, sizeof(text));
      i.v4.push_back(text);
    } else if (a->ifa_addr->sa_family == AF_INET6) {
      ::inet_ntop(
          AF_INET6,
          &reinterpret_cast<struct sockaddr_in6*>(a->ifa_addr)->sin6_addr,
          text, sizeof(text));
      i.v6.push_back(text);
    }
  }
  ::freeifaddrs(list);
  return out;
}

}  // namespace

absl::StatusOr<std::vector<Rail>> ResolveRails(const std::string& spec,
                                               size_t max_rails) {
  std::vector<Rail> rails;
  const std::string trimmed(absl::StripAsciiWhitespace(spec));
  if (trimmed.empty()) return rails;
  absl::StatusOr<std::map<std::string, Interface>> host = HostInterfaces();
  if (!host.ok()) return host.status();
  if (trimmed == "auto") {
    for (const auto& [name, i] : *host) {
      if (i.up && !i.loopback && !i.v4.empty()) rails.push_back({i.v4[0], name});
    }
    if (rails.empty()) {
      return absl::InvalidArgumentError(
          "--rails=auto: no interface is up, not loopback and holds an IPv4 "
          "address");
    }
  } else {
    for (absl::string_view entry : absl::StrSplit(trimmed, ',')) {
      const std::string e(absl::StripAsciiWhitespace(entry));
      std::string address, device;
      auto named = host->find(e);
      if (named != host->end()) {
        const Interface& i = named->second;
        address = !i.v4.empty() ? i.v4[0] : !i.v6.empty() ? i.v6[0] : "";
        device = e;
        if (address.empty()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "--rails: interface ", e, " holds no IP address"));
        }
      } else {
        std::vector<std::string> all;
        for (const auto& [name, i] : *host) {
          for (const std::string& a : i.v4) all.push_back(a);
          for (const std::string& a : i.v6) all.push_back(a);
          for (const auto* list : {&i.v4, &i.v6}) {
            if (device.empty() &&
                std::find(list->begin(), list->end(), e) != list->end()) {
              device = name;
            }
          }
        }
        if (std::find(all.begin(), all.end(), e) == all.end()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "--rails: \"", e, "\" is neither an interface nor an address "
              "of this host (its addresses: ", absl::StrJoin(all, ", "), ")"));
        }
        address = e;
      }
      for (const Rail& r : rails) {
        if (r.address == address) {
          return absl::InvalidArgumentError(absl::StrCat(
              "--rails: ", address, " is named twice"));
        }
      }
      rails.push_back({address, device});
    }
  }
  if (rails.size() > max_rails) {
    std::vector<std::string> addresses;
    for (const Rail& r : rails) addresses.push_back(r.address);
    return absl::InvalidArgumentError(absl::StrCat(
        "--rails: ", rails.size(), " rails (", absl::StrJoin(addresses, ", "),
        "), at most ", max_rails));
  }
  return rails;
}

}  // namespace ferry
