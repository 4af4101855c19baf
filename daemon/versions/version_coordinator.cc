// VersionCoordinator (version_coordinator.h): its lifecycle (start,
// shutdown), finding a run, and the Versions RPCs that begin, commit, abort
// and wait for a version (BeginVersion, CommitVersion, AbortVersion,
// WaitForVersion). The state machine those runs go through is
// run_state_machine.cc; the rank event channel, the transfer queue,
// deadlines and progress live in the files named after them.
#include "daemon/versions/version_coordinator.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/region_copy.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {

VersionCoordinator::VersionCoordinator(const Options& options,
                                       PlanCache* plans,
                                       LocalExecutor* executor)
    : options_(options),
      clock_(options.clock != nullptr ? options.clock : Clock::Real()),
      plans_(plans),
      transfers_(
          TransferQueue::Options{options.node, options.relay_wait,
                                 options.transfer_workers,
                                 options.max_staging_bytes},
          mu_, changed_, this, executor),
      offloads_(mu_, changed_, this, plans, options.devices),
      deliveries_(mu_, changed_, this, plans),
      adapters_(mu_, changed_, this, plans, options.version_timeout) {}

VersionCoordinator::~VersionCoordinator() { Shutdown(absl::ZeroDuration()); }

void VersionCoordinator::Start() {
  RemoveStaleStaging();
  LOG(INFO) << "staging limit " << transfers_.max_staging_bytes()
            << " bytes";
  started_ = true;
  transfers_.Start(remote_, checksums_);
  deadline_thread_ = std::thread([this] { DeadlineLoop(); });
  deliveries_.Start();
}

void VersionCoordinator::Shutdown(absl::Duration drain) {
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      shutting_down_ = true;
      const absl::Time deadline = absl::Now() + drain;
      auto busy = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
        for (const auto& [name, s] : streams_) {
          if (s.current != nullptr || s.delivery != nullptr) return true;
        }
        return false;
      };
      while (busy() && absl::Now() < deadline) {
        changed_.WaitWithDeadline(&mu_, deadline);
      }
      std::vector<std::shared_ptr<VersionRun>> runs;
      for (auto& [name, s] : streams_) {
        if (s.current != nullptr) runs.push_back(s.current);
        if (s.delivery != nullptr) runs.push_back(s.delivery);
      }
      for (auto& run : runs) AbortRunLocked(*run, AbortCause::kShutdown, "ferryd is shutting down");
      // Transfers notice the cancel flag between buckets.
      const absl::Time hard = absl::Now() + absl::Seconds(10);
      while (busy() && absl::Now() < hard) {
        changed_.WaitWithDeadline(&mu_, hard);
      }
      // Runs that did not settle even so answer their commits now.
      for (auto& run : runs) AnswerCommitsLocked(*run);
      stopping_ = true;
      for (auto& [id, c] : channels_) {
        EndSubscriptionLocked(c,
                              absl::UnavailableError("ferryd is shutting down"));
      }
      transfers_.AssertHeld();  // mu_ is its lock
      transfers_.StopLocked();
      deliveries_.AssertHeld();  // mu_ is its lock too
      deliveries_.StopLocked();
      changed_.SignalAll();
    }
  }
  transfers_.Join();
  if (deadline_thread_.joinable()) deadline_thread_.join();
  deliveries_.Join();
}

std::shared_ptr<VersionRun>
VersionCoordinator::FindRunLocked(const std::string& stream,
                                  int64_t version) const {
  auto it = streams_.find(stream);
  if (it == streams_.end()) return nullptr;
  const StreamState& st = it->second;
  if (st.current != nullptr && st.current->version == version) {
    return st.current;
  }
  for (const auto& run : st.history) {
    if (run->version == version) return run;
  }
  return nullptr;
}

std::shared_ptr<VersionRun>
VersionCoordinator::FindRunBySerialLocked(const std::string& stream,
                                          uint64_t serial) const {
  auto it = streams_.find(stream);
  if (it == streams_.end()) return nullptr;
  const StreamState& st = it->second;
  for (const auto& run : {st.current, st.delivery, st.last_delivery}) {
    if (run != nullptr && run->serial == serial) return run;
  }
  for (const auto& run : st.history) {
    if (run->serial == serial) return run;
  }
  return nullptr;
}

absl::StatusOr<std::vector<std::string>> VersionCoordinator::BeginVersion(
    const std::shared_ptr<const Participant>& source, int64_t version,
    const Expired& expired) {
  const std::string& stream = source->stream;
  if (version <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "stream ", stream, ": BeginVersion(", version,
        ") from rank ", source->rank, ": versions are positive"));
  }
  // Planning may take a while on a large model: outside the lock.
  absl::StatusOr<std::shared_ptr<const StreamPlan>> plan = plans_->Get(stream);
  if (!plan.ok()) return plan.status();
  if (expired && expired()) {
    return absl::DeadlineExceededError(absl::StrCat(
        "stream ", stream, ": BeginVersion(", version, ") from rank ",
        source->rank, ": the call's deadline passed while planning; nothing "
        "was begun"));
  }

  absl::MutexLock lock(&mu_);
  if (shutting_down_) {
    return absl::UnavailableError("ferryd is shutting down");
  }
  StreamState& st = streams_[stream];
  // A donor delivery reads an instance that this version would overwrite:
  // the version waits for it to settle (it has deadlines of its own).
  while (st.delivery != nullptr && !shutting_down_) {
    if (expired && expired()) {
      return absl::DeadlineExceededError(absl::StrCat(
          "stream ", stream, ": BeginVersion(", version, ") from rank ",
          source->rank, " waited for the ", RunKindName(st.delivery->kind),
          " of instance ", st.delivery->instances[0].id, " from ",
          st.delivery->donor, ", which did not settle before the call's "
          "deadline; nothing was begun"));
    }
    changed_.WaitWithTimeout(&mu_, absl::Milliseconds(100));
  }
  if (shutting_down_) {
    return absl::UnavailableError("ferryd is shutting down");
  }
  auto ids_of = [](const VersionRun& run) {
    std::vector<std::string> ids;
    for (const InstanceRun& inst : run.instances) ids.push_back(inst.id);
    return ids;
  };
  if (st.current != nullptr) {
    if (st.current->version != version) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stream ", stream, ": BeginVersion(", version, ") from rank ",
          source->rank, " while version ", st.current->version,
          " is in progress; one version at a time"));
    }
    st.current->begun.insert(source->rank);  // joining, or a repeat
    return ids_of(*st.current);
  }
  if (version <= st.last_begun) {
    return absl::FailedPreconditionError(absl::StrCat(
        "stream ", stream, ": BeginVersion(", version, ") from rank ",
        source->rank, ": version ", st.last_begun,
        " was begun before; versions must increase and are never reused"));
  }
  const StreamPlan& sp = **plan;
  // Sources incomplete (or not tiling the model): no version can start.
  if (!sp.source_error.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat("BeginVersion(", version, "): ", sp.source_error));
  }
  for (const auto& s : sp.sources) {
    if (s == nullptr || s->removed.load()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stream ", stream, ": not every source rank is registered"));
    }
  }

  auto run = std::make_shared<VersionRun>();
  run->serial = next_run_serial_++;
  run->stream = stream;
  run->version = version;
  run->plan = *plan;
  run->world_size = sp.trainer_ranks();
  run->begun.insert(source->rank);
  run->begun_at = absl::Now();
  if (metrics_ != nullptr) metrics_->VersionBegun(run->stream, "version");
  for (size_t i = 0; i < sp.instances.size(); ++i) {
    if (RetiringAdapter(sp.instances[i])) continue;
    run->instances.push_back(NewInstanceRunLocked(sp, i));
  }
  st.current = run;
  st.last_begun = version;
  LOG(INFO) << "stream " << stream << ": version " << version << " begun by rank "
            << source->rank << " for " << run->instances.size()
            << " instances";

  for (InstanceRun& inst : run->instances) StartInstance(*run, inst);
  Advance(run);
  return ids_of(*run);
}

void VersionCoordinator::CommitVersion(const Participant& source,
                                       int64_t version, CommitDone done) {
  absl::Status refused = CountCommit(source, version, done);
  if (!refused.ok()) done(std::move(refused));
}

absl::Status VersionCoordinator::CountCommit(const Participant& source,
                                             int64_t version,
                                             CommitDone& done) {
  const std::string& stream = source.stream;
  absl::MutexLock lock(&mu_);
  std::shared_ptr<VersionRun> run = FindRunLocked(stream, version);
  if (run == nullptr) {
    auto it = streams_.find(stream);
    if (it != streams_.end() && it->second.current != nullptr) {
      return absl::FailedPreconditionError(absl::StrCat(
          "stream ", stream, ": CommitVersion(", version, ") from rank ",
          source.rank, " but version ", it->second.current->version,
          " is in progress"));
    }
    return absl::FailedPreconditionError(
        absl::StrCat("stream ", stream, ": CommitVersion(", version,
                     ") without BeginVersion(", version, ") from rank ",
                     source.rank));
  }
  if (!run->begun.count(source.rank)) {
    return absl::FailedPreconditionError(
        absl::StrCat("stream ", stream, ": CommitVersion(", version,
                     ") without BeginVersion(", version, ") from rank ",
                     source.rank));
  }
  if (!run->settled && !run->committed.count(source.rank)) {
    if (run->committed.empty()) {
      run->deadline = clock_->Now() + options_.version_timeout;
    }
    run->committed.insert(source.rank);
    Advance(run);
  }
  // Every run settles: the deadline thread aborts what is late (ack and
  // version timeouts), and Shutdown what is left. No thread waits for it:
  // a fleet's trainer has hundreds of ranks committing at once.
  run->on_settled.push_back(std::move(done));
  if (run->settled) AnswerCommitsLocked(*run);
  return absl::OkStatus();
}

absl::StatusOr<std::vector<v1::InstanceStatus>>
VersionCoordinator::AbortVersion(const Participant& source, int64_t version,
                                 const std::string& reason) {
  if (reason.empty()) {
    return absl::InvalidArgumentError("AbortVersion: reason is required");
  }
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(source.stream);
  if (it == streams_.end() || it->second.current == nullptr ||
      it->second.current->version != version) {
    return absl::FailedPreconditionError(
        absl::StrCat("stream ", source.stream, ": AbortVersion(", version,
                     ") from rank ", source.rank,
                     ", but that version is not in progress"));
  }
  std::shared_ptr<VersionRun> run = it->second.current;
  AbortRunLocked(*run, AbortCause::kSourceAbort,
                 absl::StrCat("AbortVersion by source rank ",
                                    source.rank, ": ", reason));
  while (!run->settled) changed_.WaitWithTimeout(&mu_, absl::Seconds(1));
  return OutcomeLocked(*run);
}

absl::StatusOr<std::vector<v1::InstanceStatus>>
VersionCoordinator::WaitForVersion(const std::string& stream, int64_t version,
                                   const std::string& instance_id,
                                   absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  absl::MutexLock lock(&mu_);
  auto it = streams_.find(stream);
  if (it == streams_.end() || version > it->second.last_begun) {
    return absl::NotFoundError(absl::StrCat(
        "stream ", stream, " never began version ", version));
  }
  std::shared_ptr<VersionRun> run = FindRunLocked(stream, version);
  if (run == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        "stream ", stream, ": this daemon keeps no record of version ",
        version, " (not begun, or too old)"));
  }
  std::vector<size_t> wanted;
  for (size_t i = 0; i < run->instances.size(); ++i) {
    if (instance_id.empty() || run->instances[i].id == instance_id) {
      wanted.push_back(i);
    }
  }
  if (!instance_id.empty() && wanted.empty()) {
    return absl::NotFoundError(absl::StrCat(
        "instance ", instance_id, " does not take part in stream ", stream,
        " version ", version));
  }
  while (true) {
    std::vector<std::string> pending;
    for (size_t i : wanted) {
      const InstanceRun& inst = run->instances[i];
      if (!inst.settled()) {
        pending.push_back(absl::StrCat(
            inst.id, " (", v1::InstanceState_Name(Status(*run, inst).state()),
            ")"));
      }
    }
    if (pending.empty()) break;
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "stream ", stream, " version ", version, ": still pending after ",
          absl::ToInt64Milliseconds(timeout), " ms: ",
          absl::StrJoin(pending, ", ")));
    }
    changed_.WaitWithDeadline(&mu_, deadline);
  }
  std::vector<v1::InstanceStatus> out;
  for (size_t i : wanted) out.push_back(Status(*run, run->instances[i]));
  return out;
}

}  // namespace ferry
