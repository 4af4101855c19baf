#include "daemon/local_executor.h"

#include <thread>
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

BufferPlace SourcePlace(const MemoryMap& memory, uint32_t buffer) {
  BufferPlace place;
  if (buffer >= memory.size()) return place;
  place.base = memory.base(buffer);
  place.gpu = memory.on_device(buffer) ? memory.gpu(buffer) : -1;
  place.pinned = place.gpu < 0 && memory.pinned(buffer);
  place.map = &memory;
  place.index = buffer;
  return place;
}

const char* Kind(const BufferPlace& place) {
  return place.gpu >= 0 ? "GPU memory" : "host memory";
}

absl::Status MixedCopy(const std::string& src_who, const BufferPlace& src,
                       const std::string& dst_who, const BufferPlace& dst,
                       const std::string& param, const std::string& why) {
  return absl::UnimplementedError(absl::StrCat(
      param, ": ", src_who, " holds it in ", Kind(src), " and ", dst_who,
      " in ", Kind(dst), ", and the host memory cannot be pinned for the "
      "GPUs (", why, "); register both sides in GPU memory, or both in host "
      "memory"));
}

}  // namespace

// Copies grouped by the engine that runs them; few engines (host, or one
// per GPU the bucket touches).
struct LocalExecutor::Batch {
  std::vector<std::pair<CopyEngine*, std::vector<LocalCopy>>> groups;

  std::vector<LocalCopy>& For(CopyEngine* engine) {
    for (auto& [e, copies] : groups) {
      if (e == engine) return copies;
    }
    groups.emplace_back(engine, std::vector<LocalCopy>());
    return groups.back().second;
  }
  void Clear() {
    for (auto& group : groups) group.second.clear();
  }
};

BufferPlace RankMemory::Find(uint32_t buffer) const {
  BufferPlace place;
  if (buffer & kStagingBufferBit) {
    const uint32_t k = buffer & ~kStagingBufferBit;
    if (k < staging_bases.size()) place.base = staging_bases[k];
    place.pinned = staging_pinned;
    return place;
  }
  if (client == nullptr) return place;
  return SourcePlace(*client, buffer);
}

LocalExecutor::LocalExecutor(CopyEngine* host_engine, DeviceMemory* devices)
    : host_engine_(host_engine), devices_(devices) {}

int64_t LocalExecutor::JobBytes(const TransferJob& job) {
  const PlannedInstance& inst = job.plan->instances[job.instance];
  const Plan& plan = job.relay ? job.plan->plan : job.plan->direct_plan();
  return plan.instances[inst.plan_index].bytes;
}

// The engine for a copy, or null when no engine can do it (host <-> GPU
// with the host side not pinned).
CopyEngine* LocalExecutor::EngineFor(const BufferPlace& src,
                                     const BufferPlace& dst) const {
  if (src.gpu < 0 && dst.gpu < 0) return host_engine_;
  if ((src.gpu < 0 && !src.pinned) || (dst.gpu < 0 && !dst.pinned)) {
    return nullptr;
  }
  return devices_ == nullptr ? nullptr
                             : devices_->Engine(dst.gpu >= 0 ? dst.gpu : src.gpu);
}

bool LocalExecutor::PinHostSides(BufferPlace& src, BufferPlace& dst,
                                 std::string* why) const {
  for (BufferPlace* side : {&src, &dst}) {
    if (side->gpu >= 0 || side->pinned) continue;
    if (side->map == nullptr) {
      *why = "daemon staging that is not pinned";
      return false;
    }
    absl::Status s = side->map->PinForGpus(side->index, devices_);
    if (!s.ok()) {
      *why = std::string(s.message());
      return false;
    }
    side->pinned = true;
  }
  return true;
}

absl::Status LocalExecutor::RunBatch(Batch& batch) const {
  std::vector<std::pair<CopyEngine*, std::vector<LocalCopy>>*> work;
  for (auto& group : batch.groups) {
    if (!group.second.empty()) work.push_back(&group);
  }
  std::vector<absl::Status> results(work.size());
  std::vector<std::thread> others;
  for (size_t i = 1; i < work.size(); ++i) {
    others.emplace_back([&results, &work, i] {
      results[i] = work[i]->first->Run(work[i]->second);
    });
  }
  if (!work.empty()) results[0] = work[0]->first->Run(work[0]->second);
  for (std::thread& t : others) t.join();
  for (const absl::Status& s : results) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status LocalExecutor::Execute(const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& inst = sp.instances[job.instance];
  const std::vector<RankLayout>& layout = *inst.layout;
  TransferProgress& progress = *job.progress;
  progress.bytes_total.store(JobBytes(job));
  Batch batch;

  if (job.relay) {
    // Rank r's piece i from rank r's piece i of the replica: same layout.
    // Resolve everything first, so a copy no engine can do fails the job
    // before any byte lands.
    for (int pass = 0; pass < 2; ++pass) {
      for (size_t r = 0; r < layout.size(); ++r) {
        if (progress.cancel.load()) return absl::CancelledError("cancelled");
        batch.Clear();
        int64_t bytes = 0;
        for (const Piece& piece : layout[r].pieces) {
          BufferPlace src = job.relay_source[r].Find(piece.buffer);
          BufferPlace dst = job.destination[r].Find(piece.buffer);
          if (src.base == nullptr || dst.base == nullptr) {
            return MissingBuffer(inst.ranks[r]->Describe(), piece.buffer);
          }
          CopyEngine* engine = EngineFor(src, dst);
          std::string why;
          if (engine == nullptr && pass == 0 && PinHostSides(src, dst, &why)) {
            engine = EngineFor(src, dst);
          }
          const DType dtype = sp.model.params[piece.param].dtype;
          if (engine == nullptr) {
            return MixedCopy("its relay replica", src,
                             inst.ranks[r]->Describe(), dst,
                             sp.model.params[piece.param].name, why);
          }
          if (pass == 0) continue;
          batch.For(engine).push_back(
              MakeCopy(src.base, piece, dst.base, piece, piece.box, dtype));
          bytes += BoxBytes(piece.box, dtype);
        }
        if (pass == 0) continue;
        if (absl::Status s = RunBatch(batch); !s.ok()) return s;
        progress.bytes_moved.fetch_add(bytes);
      }
    }
    return absl::OkStatus();
  }

  const InstancePlan& ip = sp.direct_plan().instances[inst.plan_index];
  for (int pass = 0; pass < 2; ++pass) {
    for (const Bucket& bucket : ip.buckets) {
      if (progress.cancel.load()) return absl::CancelledError("cancelled");
      batch.Clear();
      for (int32_t k = bucket.first_copy;
           k < bucket.first_copy + bucket.num_copies; ++k) {
        const Copy& c = ip.copies[k];
        const Piece& src = sp.source_layouts[c.src_rank].pieces[c.src_piece];
        const Piece& dst = layout[c.dst_rank].pieces[c.dst_piece];
        BufferPlace from =
            SourcePlace(*sp.sources[c.src_rank]->memory, src.buffer);
        if (from.base == nullptr) {
          return MissingBuffer(sp.sources[c.src_rank]->Describe(), src.buffer);
        }
        BufferPlace to = job.destination[c.dst_rank].Find(dst.buffer);
        if (to.base == nullptr) {
          return MissingBuffer(inst.ranks[c.dst_rank]->Describe(), dst.buffer);
        }
        CopyEngine* engine = EngineFor(from, to);
        std::string why;
        if (engine == nullptr && pass == 0 && PinHostSides(from, to, &why)) {
          engine = EngineFor(from, to);
        }
        if (engine == nullptr) {
          return MixedCopy(sp.sources[c.src_rank]->Describe(), from,
                           inst.ranks[c.dst_rank]->Describe(), to,
                           sp.model.params[c.param].name, why);
        }
        if (pass == 0) continue;
        batch.For(engine).push_back(MakeCopy(from.base, src, to.base, dst,
                                             ip.BoxOf(c, layout),
                                             sp.model.params[c.param].dtype));
      }
      if (pass == 0) continue;
      if (absl::Status s = RunBatch(batch); !s.ok()) return s;
      progress.bytes_moved.fetch_add(bucket.bytes);
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
