#include "daemon/host_executor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"

namespace ferry {
namespace {

// A box copy between two pieces whose buffers are mapped here.
LocalCopy MakeCopy(uint8_t* src_base, const Piece& src, uint8_t* dst_base,
                   const Piece& dst, const Box& box, DType dtype) {
  LocalCopy c;
  c.src.base = src_base + ByteOffsetOf(src, box, dtype);
  c.src.strides = src.strides;
  c.dst.base = dst_base + ByteOffsetOf(dst, box, dtype);
  c.dst.strides = dst.strides;
  c.extent = StorageBox(box, dtype).extent;
  c.unit_bytes = UnitBytes(dtype);
  return c;
}

absl::Status MissingBuffer(const std::string& who, uint32_t buffer) {
  return absl::InternalError(
      absl::StrCat(who, ": buffer ", buffer, " is not mapped"));
}

}  // namespace

uint8_t* RankMemory::Base(uint32_t buffer) const {
  if (buffer & kStagingBufferBit) {
    const uint32_t k = buffer & ~kStagingBufferBit;
    return k < staging_bases.size() ? staging_bases[k] : nullptr;
  }
  if (client == nullptr || buffer >= client->size()) return nullptr;
  return client->base(buffer);
}

HostExecutor::HostExecutor(CopyEngine* engine) : engine_(engine) {}

int64_t HostExecutor::JobBytes(const TransferJob& job) {
  const PlannedInstance& inst = job.plan->instances[job.instance];
  const Plan& plan = job.relay ? job.plan->plan : job.plan->direct_plan();
  return plan.instances[inst.plan_index].bytes;
}

absl::Status HostExecutor::Execute(const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& inst = sp.instances[job.instance];
  const std::vector<RankLayout>& layout = *inst.layout;
  TransferProgress& progress = *job.progress;
  progress.bytes_total.store(JobBytes(job));

  if (job.relay) {
    // Rank r's piece i from rank r's piece i of the replica: same layout.
    for (size_t r = 0; r < layout.size(); ++r) {
      if (progress.cancel.load()) return absl::CancelledError("cancelled");
      std::vector<LocalCopy> copies;
      int64_t bytes = 0;
      for (const Piece& piece : layout[r].pieces) {
        uint8_t* src = job.relay_source[r].Base(piece.buffer);
        uint8_t* dst = job.destination[r].Base(piece.buffer);
        if (src == nullptr || dst == nullptr) {
          return MissingBuffer(inst.ranks[r]->Describe(), piece.buffer);
        }
        const DType dtype = sp.model.params[piece.param].dtype;
        copies.push_back(MakeCopy(src, piece, dst, piece, piece.box, dtype));
        bytes += BoxBytes(piece.box, dtype);
      }
      absl::Status s = engine_->Run(copies);
      if (!s.ok()) return s;
      progress.bytes_moved.fetch_add(bytes);
    }
    return absl::OkStatus();
  }

  const InstancePlan& ip = sp.direct_plan().instances[inst.plan_index];
  for (const Bucket& bucket : ip.buckets) {
    if (progress.cancel.load()) return absl::CancelledError("cancelled");
    std::vector<LocalCopy> copies;
    copies.reserve(bucket.num_copies);
    for (int32_t k = bucket.first_copy;
         k < bucket.first_copy + bucket.num_copies; ++k) {
      const Copy& c = ip.copies[k];
      const Piece& src = sp.source_layouts[c.src_rank].pieces[c.src_piece];
      const Piece& dst = layout[c.dst_rank].pieces[c.dst_piece];
      const MemoryMap& src_memory = *sp.sources[c.src_rank]->memory;
      if (src.buffer >= src_memory.size()) {
        return MissingBuffer(sp.sources[c.src_rank]->Describe(), src.buffer);
      }
      uint8_t* dst_base = job.destination[c.dst_rank].Base(dst.buffer);
      if (dst_base == nullptr) {
        return MissingBuffer(inst.ranks[c.dst_rank]->Describe(), dst.buffer);
      }
      copies.push_back(MakeCopy(src_memory.base(src.buffer), src, dst_base,
                                dst, ip.BoxOf(c, layout),
                                sp.model.params[c.param].dtype));
    }
    absl::Status s = engine_->Run(copies);
    if (!s.ok()) return s;
    progress.bytes_moved.fetch_add(bucket.bytes);
  }
  return absl::OkStatus();
}

}  // namespace ferry
