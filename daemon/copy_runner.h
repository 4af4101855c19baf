// CopyRunner: the host executor's handle on the local CopyEngine
// (daemon/transport/local), behind a header that does not include
// daemon/transport/transport.h.
//
// Why a separate file: core/plan.h declares ferry::Channel (a plan's
// node-to-node channel) and transport.h declares ferry::Channel (a
// connection between daemons), so no translation unit can include both.
// The executor needs the plan; this file alone talks to the transport.
// (Reported to the owners; once one of the two is renamed, HostExecutor can
// take a CopyEngine directly and this file can go.)
//
// Owner: the Server, lent to the HostExecutor. Threading: thread-safe, as
// CopyEngine is.
#ifndef FERRY_DAEMON_COPY_RUNNER_H_
#define FERRY_DAEMON_COPY_RUNNER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/geometry.h"

namespace ferry {

class CopyEngine;

// One strided box copy between two mapped regions (transport.h LocalCopy).
struct BoxCopy {
  uint8_t* src = nullptr;  // the box's first unit
  Dims src_strides;        // units
  uint8_t* dst = nullptr;
  Dims dst_strides;
  Dims extent;  // storage units
  int64_t unit_bytes = 0;
};

class CopyRunner {
 public:
  // The local backend with `threads` copying threads (0: its default).
  explicit CopyRunner(int threads);
  ~CopyRunner();
  CopyRunner(const CopyRunner&) = delete;
  CopyRunner& operator=(const CopyRunner&) = delete;

  std::string name() const;
  // Copies every box; destinations must not overlap.
  absl::Status Run(const std::vector<BoxCopy>& copies);

 private:
  std::unique_ptr<CopyEngine> engine_;
};

}  // namespace ferry

#endif  // FERRY_DAEMON_COPY_RUNNER_H_
