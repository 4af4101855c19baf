#include "daemon/daemon_options.h"

#include <unistd.h>

namespace ferry {

std::string AdvertisedHost(const DaemonOptions& options) {
  const std::string& address = options.advertise_address.empty()
                                   ? options.listen_address
                                   : options.advertise_address;
  std::string host = address.substr(0, address.rfind(':'));
  if (host.empty() || host == "0.0.0.0" || host == "[::]") {
    char name[256] = {0};
    host = ::gethostname(name, sizeof(name) - 1) == 0 && name[0] != '\0'
               ? name
               : "localhost";
  }
  return host;
}

std::string ListenHost(const std::string& listen_address) {
  std::string host = listen_address.substr(0, listen_address.rfind(':'));
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  if (host == "0.0.0.0" || host == "::") return "";
  return host;
}

}  // namespace ferry
