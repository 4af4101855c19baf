// CallBatcher (daemon/cluster/call_batcher.h): each caller gets the answer
// to its own request; batches leave when full, at once without a linger;
// a batch call's error reaches every caller in it. Each case is decided by
// the batcher's structure (a full batch, an infinite linger), not by how
// fast threads run: a batcher that waited where it must not hangs the test.
#include "daemon/cluster/call_batcher.h"

#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "catch2/catch.hpp"

namespace ferry {
namespace {

using Batcher = CallBatcher<std::string, std::string>;
using Clock = std::chrono::system_clock;

// Answers "x" with "answer to x", "fail:x" with its own error; records
// the size of each batch.
struct Coordinator {
  absl::Mutex mu;
  std::vector<size_t> batches;
  absl::Status call_error;  // the whole call's, when set

  Batcher::SendFn Send() {
    return [this](const std::vector<const std::string*>& requests,
                  Batcher::Deadline) {
      absl::MutexLock lock(&mu);
      batches.push_back(requests.size());
      std::vector<absl::StatusOr<std::string>> answers;
      for (const std::string* r : requests) {
        if (!call_error.ok()) {
          answers.emplace_back(call_error);
        } else if (r->rfind("fail:", 0) == 0) {
          answers.emplace_back(absl::NotFoundError(absl::StrCat(*r, " failed")));
        } else {
          answers.emplace_back(absl::StrCat("answer to ", *r));
        }
      }
      return answers;
    };
  }
};

Batcher::Deadline Soon() { return Clock::now() + std::chrono::seconds(30); }

// `n` threads call at once; result i is the answer to request i.
std::vector<absl::StatusOr<std::string>> CallFromThreads(
    Batcher& batcher, const std::vector<std::string>& requests) {
  std::vector<absl::StatusOr<std::string>> results(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back([&, i] {
      results[i] = batcher.Call(requests[i], Soon());
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

TEST_CASE("a lone call with no linger goes at once, in a batch of one",
          "[daemon][batcher]") {
  Coordinator coordinator;
  Batcher batcher(coordinator.Send(), 16);
  absl::StatusOr<std::string> answer = batcher.Call("x", Soon());
  REQUIRE(answer.ok());
  CHECK(*answer == "answer to x");
  CHECK(coordinator.batches == std::vector<size_t>{1});
}

TEST_CASE("calls lingering for each other leave in one batch once it is full",
          "[daemon][batcher]") {
  Coordinator coordinator;
  constexpr size_t kRanks = 12;
  Batcher batcher(coordinator.Send(), kRanks);
  // An infinite linger: only a full batch can leave.
  batcher.set_linger(absl::InfiniteDuration());
  std::vector<std::string> requests;
  for (size_t i = 0; i < kRanks; ++i) {
    requests.push_back(i % 3 == 0 ? absl::StrCat("fail:", i)
                                  : absl::StrCat("rank ", i));
  }
  std::vector<absl::StatusOr<std::string>> results =
      CallFromThreads(batcher, requests);
  CHECK(coordinator.batches == std::vector<size_t>{kRanks});
  for (size_t i = 0; i < kRanks; ++i) {
    INFO("rank " << i);
    if (i % 3 == 0) {
      REQUIRE(results[i].status().code() == absl::StatusCode::kNotFound);
      CHECK(results[i].status().message() == absl::StrCat("fail:", i, " failed"));
    } else {
      REQUIRE(results[i].ok());
      CHECK(*results[i] == absl::StrCat("answer to rank ", i));
    }
  }
}

TEST_CASE("a batch holds at most max_batch calls", "[daemon][batcher]") {
  Coordinator coordinator;
  Batcher batcher(coordinator.Send(), 5);
  batcher.set_linger(absl::InfiniteDuration());
  std::vector<std::string> requests;
  for (int i = 0; i < 15; ++i) requests.push_back(absl::StrCat("rank ", i));
  std::vector<absl::StatusOr<std::string>> results =
      CallFromThreads(batcher, requests);
  CHECK(coordinator.batches == std::vector<size_t>{5, 5, 5});
  for (size_t i = 0; i < requests.size(); ++i) {
    REQUIRE(results[i].ok());
    CHECK(*results[i] == absl::StrCat("answer to rank ", i));
  }
}

TEST_CASE("a batch call's own error reaches every caller in the batch",
          "[daemon][batcher]") {
  Coordinator coordinator;
  coordinator.call_error = absl::UnavailableError("coordinator unreachable");
  Batcher batcher(coordinator.Send(), 4);
  batcher.set_linger(absl::InfiniteDuration());
  std::vector<absl::StatusOr<std::string>> results =
      CallFromThreads(batcher, {"a", "b", "c", "d"});
  for (const absl::StatusOr<std::string>& r : results) {
    CHECK(r.status().code() == absl::StatusCode::kUnavailable);
    CHECK(r.status().message() == "coordinator unreachable");
  }
}

TEST_CASE("a short answer fails the calls it left unanswered",
          "[daemon][batcher]") {
  Batcher batcher(
      [](const std::vector<const std::string*>&, Batcher::Deadline) {
        return std::vector<absl::StatusOr<std::string>>{};
      },
      4);
  absl::StatusOr<std::string> r = batcher.Call("x", Soon());
  CHECK(r.status().code() == absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace ferry
