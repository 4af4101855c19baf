// --rails (transport/tcp/host_rails.h): names and addresses of this host,
// "auto", and the refusals, each naming what it refuses.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "transport/tcp/host_rails.h"

namespace ferry {
namespace {

TEST_CASE("rails: empty is one rail with no binding") {
  absl::StatusOr<std::vector<Rail>> r = ResolveRails("", 16);
  REQUIRE(r.ok());
  CHECK(r->empty());
  CHECK(ResolveRails("  ", 16)->empty());
}

TEST_CASE("rails: an interface name gives its IPv4 address; an address of "
          "the host is kept; order is kept") {
  absl::StatusOr<std::vector<Rail>> r = ResolveRails("lo", 16);
  REQUIRE(r.ok());
  CHECK(*r == std::vector<Rail>{{"127.0.0.1", "lo"}});
  r = ResolveRails("127.0.0.1", 16);  // the interface that holds it
  REQUIRE(r.ok());
  CHECK(*r == std::vector<Rail>{{"127.0.0.1", "lo"}});
}

TEST_CASE("rails: refusals name the entry") {
  absl::StatusOr<std::vector<Rail>> r = ResolveRails("192.0.2.77", 16);
  REQUIRE_FALSE(r.ok());
  CHECK(absl::IsInvalidArgument(r.status()));
  CHECK(absl::StrContains(r.status().message(),
                          "\"192.0.2.77\" is neither an interface nor an "
                          "address of this host"));
  r = ResolveRails("lo,127.0.0.1", 16);  // the same address twice
  REQUIRE_FALSE(r.ok());
  CHECK(absl::StrContains(r.status().message(), "127.0.0.1 is named twice"));
  r = ResolveRails("lo", 0);
  REQUIRE_FALSE(r.ok());
  CHECK(absl::StrContains(r.status().message(), "1 rails (127.0.0.1), at most 0"));
  r = ResolveRails("nosuchnic0", 16);
  REQUIRE_FALSE(r.ok());
  CHECK(absl::StrContains(r.status().message(), "nosuchnic0"));
}

TEST_CASE("rails: auto takes no loopback address") {
  absl::StatusOr<std::vector<Rail>> r = ResolveRails("auto", 16);
  if (!r.ok()) {
    // A sandbox with loopback only.
    CHECK(absl::StrContains(r.status().message(), "no interface is up"));
    return;
  }
  CHECK_FALSE(r->empty());
  for (const Rail& a : *r) {
    INFO(a.address << " on " << a.device);
    CHECK_FALSE(absl::StartsWith(a.address, "127."));
    CHECK(a.address.find(':') == std::string::npos);  // IPv4
    CHECK_FALSE(a.device.empty());
  }
}

}  // namespace
}  // namespace ferry
