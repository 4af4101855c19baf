#include "client/lease_keeper.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace ferry {

LeaseKeeper::LeaseKeeper(Connection connection, v1::ParticipantHandle handle,
                         absl::Duration lease, std::string who,
                         std::function<void()> on_lost)
    : connection_(std::move(connection)),
      handle_(std::move(handle)),
      who_(std::move(who)),
      on_lost_(std::move(on_lost)),
      lease_(lease) {
  thread_ = std::thread([this] { Run(); });
}

LeaseKeeper::~LeaseKeeper() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
  }
  thread_.join();
}

absl::Status LeaseKeeper::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

void LeaseKeeper::Run() {
  while (true) {
    absl::Duration period;
    {
      absl::MutexLock lock(&mu_);
      period = std::max(lease_ / 3, absl::Milliseconds(10));
      auto stopping = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stop_; };
      mu_.AwaitWithTimeout(absl::Condition(&stopping), period);
      if (stop_) return;
    }
    v1::HeartbeatRequest request;
    *request.mutable_handle() = handle_;
    v1::HeartbeatResponse response;
    // The deadline is the period itself: a heartbeat that takes longer is
    // late anyway, and the destructor never waits longer than this.
    auto context = connection_.NewContext(period);
    const grpc::Status s =
        connection_.registry().Heartbeat(context.get(), request, &response);
    if (s.ok()) {
      absl::MutexLock lock(&mu_);
      if (response.lease_duration_ms() > 0) {
        lease_ = absl::Milliseconds(response.lease_duration_ms());
      }
      continue;
    }
    absl::Status error = FromGrpcStatus(s, absl::StrCat("Heartbeat of ", who_));
    if (s.error_code() == grpc::StatusCode::NOT_FOUND ||
        s.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
      LOG(ERROR) << error << " (lease lost: register again)";
      {
        absl::MutexLock lock(&mu_);
        status_ = std::move(error);
      }
      if (on_lost_) on_lost_();
      return;
    }
    LOG(WARNING) << error << " (retrying)";
  }
}

}  // namespace ferry
