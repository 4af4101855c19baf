// CallBatcher and AsyncCallBatcher (daemon/cluster/call_batcher.h): each
// caller gets the answer to its own request; batches leave when full, at
// once without a linger; a batch call's error reaches every caller in it;
// the async one sends what queued during a batch when that batch is
// answered, and never two batches at once. Each case is decided by
// the batcher's structure (a full batch, an infinite linger), not by how
// fast threads run: a batcher that waited where it must not hangs the test.
#include "daemon/cluster/call_batcher.h"

#include <map>
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

// AsyncCallBatcher: the test holds each batch call until it answers it,
// so what is in flight is decided by the test, not by threads' speed.
using Async = AsyncCallBatcher<std::string, std::string>;

struct HeldCalls {
  std::vector<std::vector<std::string>> batches;  // as sent
  std::vector<Async::Answered> pending;           // not answered yet

  Async::SendFn Send() {
    return [this](const std::vector<const std::string*>& requests,
                  Async::Deadline, Async::Answered answered) {
      std::vector<std::string> batch;
      for (const std::string* r : requests) batch.push_back(*r);
      batches.push_back(std::move(batch));
      pending.push_back(std::move(answered));
    };
  }
  // Answers the oldest unanswered batch: "answer to x" for each x.
  void AnswerOldest() {
    REQUIRE(!pending.empty());
    const std::vector<std::string>& batch = batches[batches.size() - pending.size()];
    std::vector<absl::StatusOr<std::string>> answers;
    for (const std::string& r : batch) answers.emplace_back("answer to " + r);
    Async::Answered answered = std::move(pending.front());
    pending.erase(pending.begin());
    answered(std::move(answers));
  }
};

TEST_CASE("async: a call goes at once; calls made while a batch is in "
          "flight leave together when it is answered, at most max_batch",
          "[daemon][batcher]") {
  HeldCalls calls;
  std::map<std::string, absl::StatusOr<std::string>> got;
  {
    Async batcher(calls.Send(), 2);
    const std::vector<std::string> requests = {"a", "b", "c", "d"};
    auto done = [&](const std::string& r) {
      return [&got, r](absl::StatusOr<std::string> answer) {
        got.emplace(r, std::move(answer));
      };
    };
    batcher.Call(requests[0], Soon(), done("a"));
    // "a" left at once, alone; it is not answered yet.
    CHECK(calls.batches == std::vector<std::vector<std::string>>{{"a"}});
    CHECK(got.empty());
    for (size_t i = 1; i < requests.size(); ++i) {
      batcher.Call(requests[i], Soon(), done(requests[i]));
    }
    // Queued behind the batch in flight: no second batch yet.
    CHECK(calls.batches.size() == 1);
    calls.AnswerOldest();
    CHECK(got.count("a") == 1);
    // Answering "a" sent the next two (max_batch), then the last.
    CHECK(calls.batches == std::vector<std::vector<std::string>>{
                               {"a"}, {"b", "c"}});
    calls.AnswerOldest();
    CHECK(calls.batches.back() == std::vector<std::string>{"d"});
    calls.AnswerOldest();
    CHECK(calls.pending.empty());
  }  // the batcher goes with nothing in flight
  REQUIRE(got.size() == 4);
  for (const auto& [r, answer] : got) {
    REQUIRE(answer.ok());
    CHECK(*answer == "answer to " + r);
  }
}

TEST_CASE("async: a batch call's error, or a short answer, reaches every "
          "caller it did not answer", "[daemon][batcher]") {
  std::vector<absl::StatusOr<std::string>> got;
  bool short_answer = false;
  Async batcher(
      [&](const std::vector<const std::string*>& requests, Async::Deadline,
          Async::Answered answered) {
        std::vector<absl::StatusOr<std::string>> answers;
        if (!short_answer) {
          for (size_t i = 0; i < requests.size(); ++i) {
            answers.emplace_back(absl::UnavailableError("coordinator gone"));
          }
        }
        answered(std::move(answers));  // at once, on the caller's thread
      },
      4);
  auto keep = [&](absl::StatusOr<std::string> a) { got.push_back(std::move(a)); };
  batcher.Call("x", Soon(), keep);
  short_answer = true;
  batcher.Call("y", Soon(), keep);
  REQUIRE(got.size() == 2);
  CHECK(got[0].status().code() == absl::StatusCode::kUnavailable);
  CHECK(got[1].status().code() == absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace ferry
