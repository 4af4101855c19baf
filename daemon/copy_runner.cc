#include "daemon/copy_runner.h"

#include "daemon/transport/local/local_copy_engine.h"
#include "daemon/transport/transport.h"

namespace ferry {

CopyRunner::CopyRunner(int threads) : engine_(CreateLocalCopyEngine(threads)) {}

CopyRunner::~CopyRunner() = default;

std::string CopyRunner::name() const { return engine_->name(); }

absl::Status CopyRunner::Run(const std::vector<BoxCopy>& copies) {
  std::vector<LocalCopy> local;
  local.reserve(copies.size());
  for (const BoxCopy& c : copies) {
    LocalCopy l;
    l.src.base = c.src;
    l.src.strides = c.src_strides;
    l.dst.base = c.dst;
    l.dst.strides = c.dst_strides;
    l.extent = c.extent;
    l.unit_bytes = c.unit_bytes;
    local.push_back(std::move(l));
  }
  return engine_->Run(local);
}

}  // namespace ferry
