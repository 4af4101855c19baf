#include "transport/local/local_copy_engine.h"

#include <algorithm>
#include <atomic>
#include <deque>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "transport/memory_fault_guard.h"
#include "transport/unit_range.h"

namespace ferry {
namespace {

// Work is cut into pieces of about total / (threads * kPiecesPerThread)
// bytes: enough pieces that a thread slowed by the OS does not hold up the
// batch, few enough that claiming one (an atomic increment) stays noise.
constexpr int64_t kPiecesPerThread = 8;
constexpr int64_t kMinPieceBytes = 256 << 10;
constexpr int64_t kMaxPieceBytes = 8 << 20;
// A Run that copies this much writes with non-temporal stores
// (StoreHint::kStreaming): more than a server's share of last-level cache,
// so cached stores would only evict what else runs there, and its
// destination (an engine's weights) is not read back by this process.
constexpr int64_t kStreamingBytes = 16 << 20;

// Units [unit_begin, unit_end) of copy `copy`.
struct CopySlice {
  size_t copy = 0;
  int64_t unit_begin = 0;
  int64_t unit_end = 0;
};

// One Run's work, shared with the workers that join it. Lives on the
// calling thread's stack: Run returns only after every worker has left it.
struct Job {
  const std::vector<LocalCopy>* copies = nullptr;
  StoreHint hint = StoreHint::kCached;
  std::vector<CopySlice> slices;
  // Piece i is slices [piece_starts[i], piece_starts[i + 1]).
  std::vector<size_t> piece_starts;
  std::atomic<size_t> next_piece{0};
  // The first copy that faulted (a client shrank its memory): once set, no
  // further piece is claimed. Written under `fault_mu`.
  absl::Mutex fault_mu;
  absl::Status fault ABSL_GUARDED_BY(fault_mu);
  std::atomic<bool> faulted{false};
  // Workers inside RunPieces. Guarded by LocalCopyEngine::mu_ (a field of
  // another object, so not expressible with ABSL_GUARDED_BY).
  int workers_inside = 0;

  size_t pieces() const { return piece_starts.size() - 1; }
};

// Claims pieces until none are left, or one faulted. Any number of threads
// may run it. Each piece runs guarded: a SIGBUS in client memory becomes
// the job's status instead of killing the daemon.
void RunPieces(Job* job) {
  const std::vector<LocalCopy>& copies = *job->copies;
  while (!job->faulted.load(std::memory_order_relaxed)) {
    const size_t piece = job->next_piece.fetch_add(1);
    if (piece >= job->pieces()) return;
    absl::Status s = RunGuarded([&] {
      for (size_t i = job->piece_starts[piece];
           i < job->piece_starts[piece + 1]; ++i) {
        const CopySlice& slice = job->slices[i];
        const LocalCopy& c = copies[slice.copy];
        CopyUnitRange(c.src, c.dst, c.extent, c.unit_bytes, slice.unit_begin,
                      slice.unit_end, job->hint);
      }
    });
    if (!s.ok()) {
      absl::MutexLock lock(&job->fault_mu);
      if (job->fault.ok()) job->fault = std::move(s);
      job->faulted.store(true);
    }
  }
}

absl::Status FaultOf(Job& job) {
  absl::MutexLock lock(&job.fault_mu);
  return job.fault;
}

class LocalCopyEngine final : public CopyEngine {
 public:
  explicit LocalCopyEngine(int threads) : threads_(threads) {
    for (int i = 1; i < threads_; ++i) {
      workers_.emplace_back([this] { WorkerLoop(); });
    }
  }

  ~LocalCopyEngine() override {
    {
      absl::MutexLock lock(&mu_);
      stopping_ = true;
    }
    for (std::thread& t : workers_) t.join();
  }

  std::string name() const override {
    return absl::StrCat("local(", threads_, " threads)");
  }

  absl::Status Run(const std::vector<LocalCopy>& copies) override {
    Job job;
    job.copies = &copies;
    if (absl::Status s = Plan(copies, &job); !s.ok()) return s;
    if (job.pieces() <= 1 || workers_.empty()) {
      RunPieces(&job);
      return FaultOf(job);
    }
    {
      absl::MutexLock lock(&mu_);
      jobs_.push_back(&job);  // workers waiting in Await see it on unlock
    }
    RunPieces(&job);
    // Every piece is claimed; wait for the workers still copying theirs.
    absl::MutexLock lock(&mu_);
    auto it = std::find(jobs_.begin(), jobs_.end(), &job);
    if (it != jobs_.end()) jobs_.erase(it);
    auto drained = [&job]() { return job.workers_inside == 0; };
    mu_.Await(absl::Condition(&drained));
    return FaultOf(job);
  }

 private:
  // Validates the copies and cuts them into pieces.
  absl::Status Plan(const std::vector<LocalCopy>& copies, Job* job) const {
    std::vector<int64_t> bytes(copies.size());
    int64_t total = 0;
    for (size_t i = 0; i < copies.size(); ++i) {
      const LocalCopy& c = copies[i];
      const std::string what = absl::StrCat("copy ", i);
      int64_t dst_bytes = 0;
      absl::Status s =
          ValidateRegionBox(c.src, c.extent, c.unit_bytes, what, &bytes[i]);
      if (s.ok()) {
        s = ValidateRegionBox(c.dst, c.extent, c.unit_bytes, what, &dst_bytes);
      }
      if (!s.ok()) return s;
      total += bytes[i];
    }
    if (total >= kStreamingBytes) job->hint = StoreHint::kStreaming;
    const int64_t piece_bytes = std::clamp(
        total / (threads_ * kPiecesPerThread), kMinPieceBytes, kMaxPieceBytes);
    // Large copies become several slices of about piece_bytes; consecutive
    // small ones are grouped into one piece.
    job->piece_starts.push_back(0);
    int64_t in_piece = 0;
    for (size_t i = 0; i < copies.size(); ++i) {
      if (bytes[i] == 0) continue;
      const int64_t units = Volume(copies[i].extent);
      const int64_t step =
          std::max<int64_t>(1, piece_bytes / copies[i].unit_bytes);
      for (int64_t begin = 0; begin < units; begin += step) {
        const int64_t end = std::min(units, begin + step);
        job->slices.push_back(CopySlice{i, begin, end});
        in_piece += (end - begin) * copies[i].unit_bytes;
        if (in_piece >= piece_bytes) {
          job->piece_starts.push_back(job->slices.size());
          in_piece = 0;
        }
      }
    }
    if (job->piece_starts.back() != job->slices.size()) {
      job->piece_starts.push_back(job->slices.size());
    }
    return absl::OkStatus();
  }

  void WorkerLoop() {
    while (true) {
      Job* job = nullptr;
      {
        absl::MutexLock lock(&mu_);
        auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stopping_ || !jobs_.empty();
        };
        mu_.Await(absl::Condition(&ready));
        if (jobs_.empty()) return;  // stopping, and nothing left to help
        job = jobs_.front();
        ++job->workers_inside;
      }
      RunPieces(job);
      absl::MutexLock lock(&mu_);
      // The job has no unclaimed piece: stop offering it to other workers.
      if (!jobs_.empty() && jobs_.front() == job) jobs_.pop_front();
      --job->workers_inside;  // after this the job may be gone
    }
  }

  const int threads_;
  absl::Mutex mu_;
  // Runs with pieces left to claim, oldest first; workers help the front.
  std::deque<Job*> jobs_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  // Started in the constructor, joined in the destructor; never resized.
  std::vector<std::thread> workers_;
};

}  // namespace

std::unique_ptr<CopyEngine> CreateLocalCopyEngine(int threads) {
  if (threads <= 0) {
    const int cores = static_cast<int>(std::thread::hardware_concurrency());
    threads = std::max(1, std::min(4, cores));
  }
  return std::make_unique<LocalCopyEngine>(threads);
}

}  // namespace ferry
