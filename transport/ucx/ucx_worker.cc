#include "transport/ucx/ucx_worker.h"

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <map>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace ferry {

absl::Status UcsStatus(ucs_status_t status, const std::string& what) {
  if (status == UCS_OK) return absl::OkStatus();
  const std::string message =
      absl::StrCat(what, ": ", ucs_status_string(status));
  switch (status) {
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_EXCEEDS_LIMIT:
      return absl::ResourceExhaustedError(message);
    case UCS_ERR_TIMED_OUT:
      return absl::DeadlineExceededError(message);
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_NO_DEVICE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
      return absl::UnavailableError(message);
    case UCS_ERR_MESSAGE_TRUNCATED:
      return absl::DataLossError(message);
    case UCS_ERR_CANCELED:
      return absl::CancelledError(message);
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_UNSUPPORTED:
      return absl::InvalidArgumentError(message);
    default:
      return absl::InternalError(message);
  }
}

absl::StatusOr<ucp_context_h> SharedUcpContext(const std::string& transports,
                                               const std::string& net_devices) {
  static absl::Mutex mu(absl::kConstInit);
  static auto* contexts ABSL_GUARDED_BY(mu) =
      new std::map<std::string, ucp_context_h>();
  absl::MutexLock lock(&mu);
  const std::string key = transports + "\n" + net_devices;
  auto it = contexts->find(key);
  if (it != contexts->end()) return it->second;
  ucp_config_t* config = nullptr;
  ucs_status_t st = ucp_config_read(nullptr, nullptr, &config);
  if (st != UCS_OK) return UcsStatus(st, "ucp_config_read");
  if (!transports.empty()) {
    st = ucp_config_modify(config, "TLS", transports.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return UcsStatus(st, absl::StrCat("UCX transports \"", transports, "\""));
    }
  }
  // A rail's channels use that rail's NIC only (UCX_NET_DEVICES).
  if (!net_devices.empty()) {
    st = ucp_config_modify(config, "NET_DEVICES", net_devices.c_str());
    if (st != UCS_OK) {
      ucp_config_release(config);
      return UcsStatus(st, absl::StrCat("UCX net devices \"", net_devices, "\""));
    }
  }
  ucp_params_t params = {};
  params.field_mask = UCP_PARAM_FIELD_FEATURES |
                      UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                      UCP_PARAM_FIELD_NAME;
  params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
  // Workers of one context run on different threads (one each).
  params.mt_workers_shared = 1;
  params.name = "ferry";
  ucp_context_h context = nullptr;
  st = ucp_init(&params, config, &context);
  ucp_config_release(config);
  if (st != UCS_OK) {
    return UcsStatus(st, absl::StrCat("ucp_init with transports \"",
                                      transports, "\""));
  }
  contexts->emplace(key, context);
  return context;
}

absl::StatusOr<std::unique_ptr<UcxWorker>> UcxWorker::Create(
    ucp_context_h context) {
  ucp_worker_params_t params = {};
  params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  params.thread_mode = UCS_THREAD_MODE_SINGLE;
  ucp_worker_h worker = nullptr;
  ucs_status_t st = ucp_worker_create(context, &params, &worker);
  if (st != UCS_OK) return UcsStatus(st, "ucp_worker_create");
  int fd = -1;
  st = ucp_worker_get_efd(worker, &fd);
  if (st != UCS_OK) {
    ucp_worker_destroy(worker);
    return UcsStatus(st, "ucp_worker_get_efd");
  }
  return std::unique_ptr<UcxWorker>(new UcxWorker(worker, fd));
}

UcxWorker::~UcxWorker() { ucp_worker_destroy(worker_); }

absl::StatusOr<std::string> UcxWorker::Address() const {
  ucp_address_t* address = nullptr;
  size_t length = 0;
  ucs_status_t st = ucp_worker_get_address(worker_, &address, &length);
  if (st != UCS_OK) return UcsStatus(st, "ucp_worker_get_address");
  std::string out(reinterpret_cast<const char*>(address), length);
  ucp_worker_release_address(worker_, address);
  return out;
}

void UcxWorker::Progress() {
  while (ucp_worker_progress(worker_) != 0) {
  }
}

absl::Status UcxWorker::WaitUntil(
    absl::FunctionRef<bool()> done, absl::Time deadline, int watch_fd,
    absl::FunctionRef<absl::Status()> watch_readable) {
  // Until then the watched fd is left out of the sleep: it stayed readable
  // (end of file) and watch_readable() said to keep waiting.
  absl::Time quiet_until = absl::InfinitePast();
  while (true) {
    Progress();
    if (done()) return absl::OkStatus();
    const absl::Time now = absl::Now();
    if (now >= deadline) {
      return absl::DeadlineExceededError("deadline passed");
    }
    // Events that arrived since the last progress make arm return BUSY:
    // progress again rather than sleep past them.
    const ucs_status_t st = ucp_worker_arm(worker_);
    if (st == UCS_ERR_BUSY) continue;
    if (st != UCS_OK) return UcsStatus(st, "ucp_worker_arm");
    struct pollfd fds[2] = {{event_fd_, POLLIN, 0}, {watch_fd, POLLIN, 0}};
    // Bounded: a transport that misses a wakeup costs at most this.
    const int timeout_ms = static_cast<int>(std::clamp<int64_t>(
        absl::ToInt64Milliseconds(deadline - now) + 1, 0, 100));
    const bool watching = watch_fd >= 0 && now >= quiet_until;
    const bool quiet = watch_fd >= 0 && !watching;
    const int n = ::poll(fds, watching ? 2 : 1,
                         quiet ? std::min(timeout_ms, 10) : timeout_ms);
    if (n < 0 && errno != EINTR) {
      return absl::InternalError(absl::StrCat("poll: errno ", errno));
    }
    if (n > 0 && watching && (fds[1].revents != 0)) {
      Progress();
      if (done()) return absl::OkStatus();
      if (absl::Status s = watch_readable(); !s.ok()) return s;
      quiet_until = absl::Now() + absl::Milliseconds(10);
    }
  }
}

}  // namespace ferry
