// CallBatcher: one kind of call a member daemon forwards to the coordinator
// for its node's ranks (an Ack, a Heartbeat), carried many at a time in one
// batch call (Versions.AckBatch, Registry.HeartbeatBatch). Each caller
// waits here while a batch carrying its request is sent, and gets the
// coordinator's answer to its own request.
//
// Why: a fleet's member holds tens of ranks, and one forwarded call per
// rank per ack and per heartbeat was most of the calls a coordinator
// served (docs/benchmarks.md, "A fleet on one coordinator"): its cost
// followed ranks, not members.
//
// When a batch leaves: as soon as none is in flight, after the linger (0:
// at once, so a lone ack waits for nothing; calls that arrive during a
// call leave together in the next one), or at once when max_batch are
// queued. A linger suits calls that are not urgent and arrive spread out,
// as heartbeats do: a rank renews its lease every third of it, so a
// linger of a twentieth delays nothing that matters.
//
// Threading: thread-safe; the caller that finds no batch in flight sends
// the batch (for everyone queued); the others wait.
#ifndef FERRY_DAEMON_CLUSTER_CALL_BATCHER_H_
#define FERRY_DAEMON_CLUSTER_CALL_BATCHER_H_

#include <chrono>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace ferry {

template <typename Request, typename Response>
class CallBatcher {
 public:
  using Deadline = std::chrono::system_clock::time_point;
  // Sends `requests` as one call that ends by `deadline` (the latest of
  // theirs) and returns one answer per request, in order; or the call's
  // own error for all of them.
  using SendFn = std::function<std::vector<absl::StatusOr<Response>>(
      const std::vector<const Request*>& requests, Deadline deadline)>;

  // REQUIRES: max_batch >= 1.
  CallBatcher(SendFn send, size_t max_batch)
      : send_(std::move(send)), max_batch_(max_batch) {}

  // How long a batch waits for more calls once one is queued (0: not at
  // all). May change at any time; the next batch uses it.
  void set_linger(absl::Duration linger) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    linger_ = linger;
  }

  // The coordinator's answer to `request`; the batch call's own error
  // (UNAVAILABLE, DEADLINE_EXCEEDED, ...) when it could not be sent.
  absl::StatusOr<Response> Call(const Request& request, Deadline deadline)
      ABSL_LOCKS_EXCLUDED(mu_) {
    Pending mine;
    mine.request = &request;
    mine.deadline = deadline;
    absl::MutexLock lock(&mu_);
    queue_.push_back(&mine);
    while (!mine.done) {
      if (sending_) {
        auto changed = [this, &mine]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return mine.done || !sending_;
        };
        mu_.Await(absl::Condition(&changed));
        continue;
      }
      // No batch in flight: this thread sends what is queued (its own
      // request among it), after the linger or once the batch is full.
      sending_ = true;
      if (linger_ > absl::ZeroDuration()) {
        auto full = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return queue_.size() >= max_batch_;
        };
        mu_.AwaitWithTimeout(absl::Condition(&full), linger_);
      }
      std::vector<Pending*> batch;
      while (!queue_.empty() && batch.size() < max_batch_) {
        batch.push_back(queue_.front());
        queue_.pop_front();
      }
      mu_.Unlock();
      Send(batch);
      mu_.Lock();
      sending_ = false;
      for (Pending* p : batch) p->done = true;
    }
    return std::move(mine.result);
  }

 private:
  struct Pending {
    const Request* request = nullptr;
    Deadline deadline;
    absl::StatusOr<Response> result;
    bool done = false;
  };

  void Send(const std::vector<Pending*>& batch) {
    std::vector<const Request*> requests;
    Deadline deadline = batch.front()->deadline;
    for (const Pending* p : batch) {
      requests.push_back(p->request);
      if (p->deadline > deadline) deadline = p->deadline;
    }
    std::vector<absl::StatusOr<Response>> answers = send_(requests, deadline);
    for (size_t i = 0; i < batch.size(); ++i) {
      batch[i]->result =
          i < answers.size()
              ? std::move(answers[i])
              : absl::StatusOr<Response>(absl::InternalError(
                    "the coordinator answered fewer requests than the batch "
                    "held"));
    }
  }

  const SendFn send_;
  const size_t max_batch_;
  absl::Mutex mu_;
  std::deque<Pending*> queue_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
  absl::Duration linger_ ABSL_GUARDED_BY(mu_) = absl::ZeroDuration();
};

// The same batching for callers that do not wait (gRPC callback
// handlers): Call queues the request and returns; `done` runs with the
// coordinator's answer on the thread that completes the batch call. The
// batch leaves at once when none is in flight; requests queued meanwhile
// leave together when it completes (no linger: it needs no thread to wait
// on). Why: a member's sync handler thread blocked per ack, and the
// futex handoffs between handler threads were a large part of a fleet
// member's CPU (docs/benchmarks.md, "A fleet on one coordinator").
//
// Threading: thread-safe. The destructor waits for a batch in flight.
template <typename Request, typename Response>
class AsyncCallBatcher {
 public:
  using Deadline = std::chrono::system_clock::time_point;
  using Done = std::function<void(absl::StatusOr<Response>)>;
  // Gets one answer per request, in order (or the call's error for all).
  using Answered = std::function<void(std::vector<absl::StatusOr<Response>>)>;
  // Starts one call for `requests` (valid until `answered` runs) that ends
  // by `deadline`, and runs `answered` once, when it completes.
  using SendFn = std::function<void(const std::vector<const Request*>& requests,
                                    Deadline deadline, Answered answered)>;

  // REQUIRES: max_batch >= 1.
  AsyncCallBatcher(SendFn send, size_t max_batch)
      : send_(std::move(send)), max_batch_(max_batch) {}
  AsyncCallBatcher(const AsyncCallBatcher&) = delete;
  AsyncCallBatcher& operator=(const AsyncCallBatcher&) = delete;
  ~AsyncCallBatcher() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](bool* sending) { return !*sending; }, &sending_));
  }

  // `request` must stay valid until `done` runs.
  void Call(const Request& request, Deadline deadline, Done done)
      ABSL_LOCKS_EXCLUDED(mu_) {
    std::vector<Pending> batch;
    {
      absl::MutexLock lock(&mu_);
      queue_.push_back(Pending{&request, deadline, std::move(done)});
      if (sending_) return;
      sending_ = true;
      batch = TakeLocked();
    }
    Send(std::move(batch));
  }

 private:
  struct Pending {
    const Request* request = nullptr;
    Deadline deadline;
    Done done;
  };

  std::vector<Pending> TakeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    std::vector<Pending> batch;
    while (!queue_.empty() && batch.size() < max_batch_) {
      batch.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    return batch;
  }

  // Sends `batch`; its completion answers it and sends what queued
  // meanwhile, until nothing is queued.
  void Send(std::vector<Pending> batch) ABSL_LOCKS_EXCLUDED(mu_) {
    std::vector<const Request*> requests;
    Deadline deadline = batch.front().deadline;
    for (const Pending& p : batch) {
      requests.push_back(p.request);
      if (p.deadline > deadline) deadline = p.deadline;
    }
    auto pending = std::make_shared<std::vector<Pending>>(std::move(batch));
    send_(requests, deadline,
          [this, pending](std::vector<absl::StatusOr<Response>> answers) {
            for (size_t i = 0; i < pending->size(); ++i) {
              (*pending)[i].done(
                  i < answers.size()
                      ? std::move(answers[i])
                      : absl::StatusOr<Response>(absl::InternalError(
                            "the coordinator answered fewer requests than "
                            "the batch held")));
            }
            std::vector<Pending> next;
            {
              absl::MutexLock lock(&mu_);
              if (queue_.empty()) {
                sending_ = false;
                return;
              }
              next = TakeLocked();
            }
            Send(std::move(next));
          });
  }

  const SendFn send_;
  const size_t max_batch_;
  absl::Mutex mu_;
  std::deque<Pending> queue_ ABSL_GUARDED_BY(mu_);
  bool sending_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_CLUSTER_CALL_BATCHER_H_
