// Rails (daemon/transfer/rail_stripe.h): which channel carries which
// bucket, and a route striped over four real TCP channels, each leaving
// from its own local address (127.0.0.2-5 to 127.0.1.1-4: every 127/8
// address is this host's), every byte checked against the source by the
// conformance suite's oracle; a rail that breaks fails the route, naming
// the rail, and stops the others.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <memory>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/transfer/rail_stripe.h"
#include "tests/transport/transport_conformance.h"
#include "transport/tcp/tcp_channel.h"

namespace ferry {
namespace {

using testing::CheckArrived;
using testing::RandomBucket;
using testing::TestBucket;
using testing::TestDeadline;

std::vector<BucketView> ViewsOfSizes(const std::vector<int64_t>& sizes) {
  std::vector<BucketView> views(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    views[i].id = i + 1;
    views[i].bytes = sizes[i];
  }
  return views;
}

// Rail r: a channel from 127.0.0.(r+2) to a listener on 127.0.1.(r+1).
struct Rails {
  std::vector<std::unique_ptr<Channel>> senders, receivers;

  explicit Rails(int n) {
    for (int r = 0; r < n; ++r) {
      TcpChannelOptions options;
      options.connection_token = absl::StrCat("rail-token-", r);
      absl::StatusOr<std::unique_ptr<TcpListener>> listener =
          TcpListener::Listen(absl::StrCat("127.0.1.", r + 1), 0, options);
      REQUIRE(listener.ok());
      options.socket.local_host = absl::StrCat("127.0.0.", r + 2);
      absl::StatusOr<std::unique_ptr<Channel>> sender = ConnectTcpChannel(
          absl::StrCat("127.0.1.", r + 1), (*listener)->port(),
          TestDeadline(), options);
      REQUIRE(sender.ok());
      absl::StatusOr<std::unique_ptr<Channel>> receiver =
          (*listener)->Accept(TestDeadline());
      REQUIRE(receiver.ok());
      senders.push_back(*std::move(sender));
      receivers.push_back(*std::move(receiver));
    }
  }
  static std::vector<Channel*> Raw(
      const std::vector<std::unique_ptr<Channel>>& channels) {
    std::vector<Channel*> out;
    for (const auto& c : channels) out.push_back(c.get());
    return out;
  }
};

TEST_CASE("stripe: every bucket on one rail, each rail's share in wire "
          "order, the rails' bytes within one bucket of each other") {
  testing::TestRng rng(11);
  for (size_t rails = 1; rails <= 6; ++rails) {
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<int64_t> sizes(rng.Uniform(0, 40));
      for (int64_t& s : sizes) s = rng.Uniform(0, 1 << 20);
      const std::vector<BucketView> views = ViewsOfSizes(sizes);
      const std::vector<std::vector<size_t>> stripe =
          StripeOverRails(views, rails);
      REQUIRE(stripe.size() == rails);
      std::vector<int> seen(views.size(), 0);
      std::vector<int64_t> load(rails, 0);
      for (size_t r = 0; r < rails; ++r) {
        CHECK(std::is_sorted(stripe[r].begin(), stripe[r].end()));
        for (size_t i : stripe[r]) {
          REQUIRE(i < views.size());
          ++seen[i];
          load[r] += sizes[i];
        }
      }
      CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
      const int64_t biggest =
          sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
      const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
      CHECK(*hi - *lo <= biggest);
      // The same sizes give the same stripe (the receiver's computation).
      CHECK(StripeOverRails(ViewsOfSizes(sizes), rails) == stripe);
    }
  }
  // Largest first onto the least-loaded rail.
  const std::vector<std::vector<size_t>> s =
      StripeOverRails(ViewsOfSizes({10, 40, 30, 20}), 2);
  CHECK(s[0] == std::vector<size_t>{0, 1});  // 40, then 10: 50
  CHECK(s[1] == std::vector<size_t>{2, 3});  // 30, then 20: 50
}

TEST_CASE("stripe: four TCP rails from their own local addresses carry a "
          "route, every byte as sent") {
  Rails rails(4);
  std::vector<TestBucket> sent, received;
  for (uint64_t seed = 1; seed <= 40; ++seed) {
    sent.push_back(RandomBucket(seed));
    received.push_back(RandomBucket(seed));
  }
  sent.push_back(testing::LargeBucket(41));
  received.push_back(testing::LargeBucket(41));
  std::vector<BucketView> send_views, receive_views;
  for (TestBucket& b : sent) send_views.push_back(b.SourceView());
  for (TestBucket& b : received) receive_views.push_back(b.DestinationView());

  absl::Status send_status;
  int64_t sent_bytes = 0;
  std::atomic<int64_t> reported{0};
  std::thread sender([&] {
    send_status = SendStriped(
        Rails::Raw(rails.senders), send_views, TestDeadline(), [] { return false; },
        [&](int64_t b) { reported += b; }, &sent_bytes);
  });
  int64_t received_bytes = 0;
  const absl::Status receive_status =
      ReceiveStriped(Rails::Raw(rails.receivers), receive_views,
                     TestDeadline(), [] { return false; }, &received_bytes);
  sender.join();
  INFO("send: " << send_status << "; receive: " << receive_status);
  REQUIRE(send_status.ok());
  REQUIRE(receive_status.ok());
  int64_t total = 0;
  for (size_t i = 0; i < sent.size(); ++i) {
    total += sent[i].bytes();
    received[i].src = sent[i].src;  // the oracle reads the sender's bytes
    CheckArrived(received[i]);
  }
  CHECK(sent_bytes == total);
  CHECK(reported.load() == total);
  CHECK(received_bytes == total);
}

TEST_CASE("stripe: a rail that breaks fails the route naming it, and the "
          "receiver returns") {
  Rails rails(4);
  std::vector<TestBucket> sent, received;
  for (uint64_t seed = 100; seed < 124; ++seed) {
    sent.push_back(RandomBucket(seed));
    received.push_back(RandomBucket(seed));
  }
  std::vector<BucketView> send_views, receive_views;
  for (TestBucket& b : sent) send_views.push_back(b.SourceView());
  for (TestBucket& b : received) receive_views.push_back(b.DestinationView());
  const std::vector<std::vector<size_t>> stripe =
      StripeOverRails(send_views, 4);
  REQUIRE_FALSE(stripe[2].empty());

  // Rail 2's sending end is gone before its first bucket; the others send
  // their shares.
  rails.senders[2].reset();
  absl::Status send_status;
  std::thread sender([&] {
    for (int r : {0, 1, 3}) {
      for (size_t i : stripe[r]) {
        if (send_status.ok()) {
          send_status = rails.senders[r]->Send(send_views[i], TestDeadline());
        }
      }
      if (send_status.ok()) {
        send_status = rails.senders[r]->Flush(TestDeadline());
      }
    }
  });
  int64_t received_bytes = 0;
  const absl::Status s =
      ReceiveStriped(Rails::Raw(rails.receivers), receive_views,
                     TestDeadline(), [] { return false; }, &received_bytes);
  sender.join();
  INFO(s << "; send: " << send_status);
  CHECK(absl::IsUnavailable(s));
  CHECK(absl::StartsWith(s.message(), "rail 2: "));
  int64_t others = 0;
  for (int r : {0, 1, 3}) {
    for (size_t i : stripe[r]) others += sent[i].bytes();
  }
  // Rail 2's share never landed; the others stopped at a bucket's end.
  CHECK(received_bytes <= others);
}

}  // namespace
}  // namespace ferry
