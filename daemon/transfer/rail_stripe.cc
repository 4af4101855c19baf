#include "daemon/transfer/rail_stripe.h"

#include <algorithm>
#include <atomic>
#include <numeric>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "daemon/memory/memory_map.h"

namespace ferry {

// Each channel's share runs on a thread of its own (the caller's for the
// first); the first failure stops the rest at their next bucket.
absl::Status RunStriped(const std::vector<Channel*>& channels,
                        const std::vector<BucketView>& views,
                        const std::function<bool()>& cancelled,
                        const MoveBucket& move,
                        const std::function<absl::Status(Channel&)>& finish,
                        const std::function<void(int64_t)>& on_bytes,
                        int64_t* moved_bytes) {
  const std::vector<std::vector<size_t>> stripe =
      StripeOverRails(views, channels.size());
  std::atomic<bool> failed{false};
  std::atomic<int64_t> moved{0};
  absl::Mutex mu;
  absl::Status first;
  auto fail = [&](size_t rail, absl::Status s) {
    absl::MutexLock lock(&mu);
    // The cause, not the channels it stopped ("cancelled").
    if (first.ok() || (absl::IsCancelled(first) && !absl::IsCancelled(s))) {
      first = channels.size() == 1
                  ? std::move(s)
                  : absl::Status(s.code(), absl::StrCat("rail ", rail, ": ",
                                                        s.message()));
    }
    failed.store(true);
  };
  auto run = [&](size_t rail) {
    Channel& channel = *channels[rail];
    for (size_t i : stripe[rail]) {
      if (failed.load()) return;
      if (cancelled && cancelled()) {
        fail(rail, absl::CancelledError("cancelled"));
        return;
      }
      absl::Status s = NameMemoryFault(move(channel, i));
      if (!s.ok()) {
        fail(rail, std::move(s));
        return;
      }
      moved.fetch_add(views[i].bytes);
      if (on_bytes) on_bytes(views[i].bytes);
    }
    if (finish && !failed.load()) {
      if (absl::Status s = finish(channel); !s.ok()) fail(rail, std::move(s));
    }
  };
  std::vector<std::thread> threads;
  for (size_t rail = 1; rail < channels.size(); ++rail) {
    threads.emplace_back(run, rail);
  }
  run(0);
  for (std::thread& t : threads) t.join();
  *moved_bytes = moved.load();
  absl::MutexLock lock(&mu);
  return first;
}

std::vector<std::vector<size_t>> StripeOverRails(
    const std::vector<BucketView>& views, size_t rails) {
  rails = std::max<size_t>(rails, 1);
  std::vector<std::vector<size_t>> stripe(rails);
  if (rails == 1) {
    stripe[0].resize(views.size());
    std::iota(stripe[0].begin(), stripe[0].end(), size_t{0});
    return stripe;
  }
  std::vector<size_t> by_size(views.size());
  std::iota(by_size.begin(), by_size.end(), size_t{0});
  std::stable_sort(by_size.begin(), by_size.end(), [&](size_t a, size_t b) {
    return views[a].bytes > views[b].bytes;
  });
  std::vector<int64_t> load(rails, 0);
  for (size_t i : by_size) {
    const size_t least = static_cast<size_t>(
        std::min_element(load.begin(), load.end()) - load.begin());
    load[least] += views[i].bytes;
    stripe[least].push_back(i);
  }
  // Each channel's share in wire order.
  for (std::vector<size_t>& share : stripe) {
    std::sort(share.begin(), share.end());
  }
  return stripe;
}

absl::Status SendStriped(const std::vector<Channel*>& channels,
                         const std::vector<BucketView>& views,
                         absl::Time deadline,
                         const std::function<bool()>& cancelled,
                         const std::function<void(int64_t)>& on_bytes,
                         int64_t* sent_bytes) {
  return RunStriped(
      channels, views, cancelled,
      [&](Channel& c, size_t i) { return c.Send(views[i], deadline); },
      [deadline](Channel& c) { return c.Flush(deadline); }, on_bytes,
      sent_bytes);
}

absl::Status ReceiveStriped(const std::vector<Channel*>& channels,
                            const std::vector<BucketView>& views,
                            absl::Time deadline,
                            const std::function<bool()>& cancelled,
                            int64_t* received_bytes) {
  return RunStriped(
      channels, views, cancelled,
      [&](Channel& c, size_t i) { return c.Receive(views[i], deadline); },
      nullptr, nullptr, received_bytes);
}

}  // namespace ferry
