// UCX plumbing under the ucx channel: the process's UCP contexts and one
// UCP worker with the waits the channel needs.
//
// A UCP context is the library's view of the machine's transports (tcp,
// shared memory, InfiniBand/RoCE, GPU memory where UCX is built with
// CUDA); ferryd makes one per transport list (UCX_TLS) and keeps it for
// the process's life. A worker is a progress engine: every send and
// receive completes only while some thread calls its progress function.
// The ucx channel gives each worker exactly one thread (UCS_THREAD_MODE_
// SINGLE: no lock inside UCX), and waits on the worker's event fd instead
// of spinning, so an idle channel costs no CPU.
#ifndef FERRY_TRANSPORT_UCX_UCX_WORKER_H_
#define FERRY_TRANSPORT_UCX_UCX_WORKER_H_

#include <ucp/api/ucp.h>

#include <cstdint>
#include <memory>
#include <string>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace ferry {

// The status of a UCX call as an absl::Status naming `what`.
absl::Status UcsStatus(ucs_status_t status, const std::string& what);

// The process-wide UCP context for transport list `transports` (UCX_TLS
// syntax: "tcp", "sm", "rc,sm", ...; empty: UCX's own choice, which reads
// UCX_TLS from the environment). Created on first use, never destroyed.
// Thread-safe.
absl::StatusOr<ucp_context_h> SharedUcpContext(
    const std::string& transports, const std::string& net_devices = "");

class UcxWorker {
 public:
  static absl::StatusOr<std::unique_ptr<UcxWorker>> Create(
      ucp_context_h context);
  ~UcxWorker();
  UcxWorker(const UcxWorker&) = delete;
  UcxWorker& operator=(const UcxWorker&) = delete;

  ucp_worker_h get() const { return worker_; }
  // The worker's address, for the peer's ucp_ep_create.
  absl::StatusOr<std::string> Address() const;

  // Progresses the worker until done() (checked after each round of
  // progress) or the deadline. While nothing happens it sleeps on the
  // worker's event fd and on `watch_fd` (if >= 0); when `watch_fd` turns
  // readable it returns what watch_readable() returns unless that is OK
  // (keep waiting: the fd is then left out of the sleep for 10 ms, since a
  // closed connection stays readable). DEADLINE_EXCEEDED at the deadline.
  absl::Status WaitUntil(absl::FunctionRef<bool()> done, absl::Time deadline,
                         int watch_fd,
                         absl::FunctionRef<absl::Status()> watch_readable);
  // One round of progress without waiting.
  void Progress();

 private:
  UcxWorker(ucp_worker_h worker, int event_fd)
      : worker_(worker), event_fd_(event_fd) {}
  ucp_worker_h const worker_;
  const int event_fd_;
};

}  // namespace ferry

#endif  // FERRY_TRANSPORT_UCX_UCX_WORKER_H_
