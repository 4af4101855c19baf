// A route's buckets as forms and patches (daemon/transfer/delta_routes.h)
// over a real TCP channel on loopback: a patch lands exact where the
// destination holds the shadow's version; a box landing in staging goes
// dense; and what a peer may send instead (a form that is not one, a
// patch as large as its bucket, a patch that does not parse) is DATA_LOSS
// with the destination untouched.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "absl/strings/match.h"
#include "core/piece.h"
#include "daemon/transfer/delta_routes.h"
#include "transport/tcp/tcp_channel.h"

namespace ferry {
namespace {

constexpr int64_t kBytes = 4096;
constexpr uint64_t kFormBit = uint64_t{1} << 63;

absl::Time Deadline() { return absl::Now() + absl::Seconds(20); }

struct Pair {
  std::unique_ptr<Channel> sender, receiver;
  Pair() {
    auto listener = TcpListener::Listen("127.0.0.1", 0);
    REQUIRE(listener.ok());
    auto s = ConnectTcpChannel("127.0.0.1", (*listener)->port(), Deadline());
    REQUIRE(s.ok());
    auto r = (*listener)->Accept(Deadline());
    REQUIRE(r.ok());
    sender = *std::move(s);
    receiver = *std::move(r);
  }
};

BucketView Contiguous(uint64_t id, uint8_t* data, int64_t bytes,
                      int64_t unit) {
  BucketView v;
  v.id = id;
  v.regions.push_back(RegionView{data, {1}});
  v.extents.push_back({bytes / unit});
  v.unit_bytes.push_back(unit);
  v.bytes = bytes;
  return v;
}

// The source: one buffer of a map, a route of one bucket over all of it.
struct Route {
  std::unique_ptr<MemoryMap> map = MemoryMap::OwnedHost({kBytes});
  std::vector<BucketView> views{Contiguous(7, map->base(0), kBytes, 2)};
  std::vector<std::vector<BufferPlace>> places{
      {BufferPlace{map->base(0), -1, false, map.get(), 0}}};
  v1::RunTransferRequest Receiver(int64_t version, int64_t base,
                                  uint32_t buffer = 0) const {
    v1::RunTransferRequest r;
    r.set_version(version);
    r.set_delta_base(base);
    r.add_receive()->add_boxes()->set_buffer(buffer);
    return r;
  }
};

TEST_CASE("delta routes: a patch where the destination holds the shadow's "
          "version, dense into staging and where it does not") {
  Pair pair;
  Route route;
  std::mt19937 rng(3);
  for (int64_t i = 0; i < kBytes; ++i) route.map->base(0)[i] = rng();
  DeltaShadows shadows(1 << 20);
  std::vector<uint8_t> dst(kBytes, 0);
  const BucketView into = Contiguous(7, dst.data(), kBytes, 2);
  auto version = [&](const v1::RunTransferRequest& req) {
    DeltaCounts sent, received;
    DeltaSender sender(&shadows, req, route.views, route.places, &sent);
    REQUIRE(sender.Send(*pair.sender, 0, Deadline()).ok());
    REQUIRE(ReceiveDelta(*pair.receiver, into, Deadline(), &received, "r").ok());
    CHECK(received.patched_bytes.load() == sent.patched_bytes.load());
    CHECK(received.patch_bytes.load() == sent.patch_bytes.load());
    CHECK(std::memcmp(dst.data(), route.map->base(0), kBytes) == 0);
    return received.patched_bytes.load();
  };
  CHECK(version(route.Receiver(1, 0)) == 0);  // first sight: dense
  for (int i = 0; i < 10; ++i) route.map->base(0)[rng() % kBytes] ^= 0x55;
  CHECK(version(route.Receiver(2, 1)) == kBytes);  // a patch, exact
  route.map->base(0)[100] ^= 1;
  // Into staging: dense though the base matches.
  CHECK(version(route.Receiver(3, 2, kStagingBufferBit)) == 0);
  route.map->base(0)[200] ^= 1;
  // A destination that holds another version than the shadow's: dense.
  CHECK(version(route.Receiver(4, 2)) == 0);
}

TEST_CASE("delta routes: forms and patches a peer should not send are "
          "DATA_LOSS, the destination untouched") {
  std::vector<uint8_t> dst(kBytes, 0xEE);
  const BucketView into = Contiguous(9, dst.data(), kBytes, 2);
  auto receive = [&](uint64_t form, uint64_t size,
                     std::vector<uint8_t> payload) {
    Pair pair;
    uint64_t words[2] = {form, size};
    REQUIRE(pair.sender
                ->Send(Contiguous(9 ^ kFormBit,
                                  reinterpret_cast<uint8_t*>(words), 16, 1),
                       Deadline())
                .ok());
    if (!payload.empty()) {
      REQUIRE(pair.sender
                  ->Send(Contiguous(9, payload.data(), payload.size(), 1),
                         Deadline())
                  .ok());
    }
    DeltaCounts counts;
    return ReceiveDelta(*pair.receiver, into, Deadline(), &counts, "route x");
  };
  absl::Status s = receive(7, 10, {});
  CHECK(absl::IsDataLoss(s));
  CHECK(absl::StrContains(s.message(), "route x bucket 9: form 7 of 10 bytes"));
  s = receive(1, kBytes, {});  // a "patch" as large as the bucket
  CHECK(absl::IsDataLoss(s));
  CHECK(absl::StrContains(s.message(), "for a bucket of 4096"));
  s = receive(1, 0, {});
  CHECK(absl::IsDataLoss(s));
  s = receive(1, 20, std::vector<uint8_t>(20, 0xFF));  // does not parse
  CHECK(absl::IsDataLoss(s));
  CHECK(absl::StrContains(s.message(), "route x bucket 9: patch"));
  CHECK(std::all_of(dst.begin(), dst.end(), [](uint8_t b) { return b == 0xEE; }));
}

}  // namespace
}  // namespace ferry
