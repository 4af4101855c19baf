#include "daemon/transfer/local_executor.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/region_copy.h"
#include "daemon/registry/participant.h"

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

// Where one box goes: its engine and the bases of its two ends.
struct Routed {
  CopyEngine* engine;
  uint8_t* src;
  uint8_t* dst;
};

absl::Status MissingBuffer(const std::string& who, uint32_t buffer) {
  return absl::InternalError(
      absl::StrCat(who, ": buffer ", buffer, " is not mapped"));
}

absl::Status MixedCopy(const std::string& src_who, const BufferPlace& src,
                       const std::string& dst_who, const BufferPlace& dst,
                       const std::string& param, const absl::Status& why) {
  return absl::Status(
      why.code(), absl::StrCat(param, ": ", src_who, " holds it in ",
                               KindOf(src), " and ", dst_who, " in ",
                               KindOf(dst), ", and ", why.message()));
}

}  // namespace

LocalExecutor::LocalExecutor(CopyEngine* host_engine, DeviceMemory* devices)
    : router_(host_engine, devices) {}

absl::Status LocalExecutor::Execute(const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& inst = sp.instances[job.instance];
  const std::vector<RankLayout>& layout = *inst.layout;
  TransferProgress& progress = *job.progress;
  progress.bytes_total.store(JobBytes(job));
  CopyRouter::Batch batch;

  // An exchange's parts (TransferJob::part) do not run here: partners and
  // sources are on nodes other than the instance's (core/exchange.h). Were
  // one to, it would copy every bucket from the sources: right, only more.
  if (job.relay) {
    // Rank r's piece i from rank r's piece i of the replica: same layout.
    // Every piece is routed first, so one no engine can do fails the job
    // before any byte lands.
    std::vector<std::vector<Routed>> routed(layout.size());
    for (size_t r = 0; r < layout.size(); ++r) {
      for (const Piece& piece : layout[r].pieces) {
        BufferPlace src = job.relay_source[r].Find(piece.buffer);
        BufferPlace dst = job.destination[r].Find(piece.buffer);
        if (src.base == nullptr || dst.base == nullptr) {
          return MissingBuffer(inst.ranks[r]->Describe(), piece.buffer);
        }
        absl::StatusOr<CopyEngine*> engine = router_.EngineFor(src, dst);
        if (!engine.ok()) {
          return MixedCopy("its relay replica", src, inst.ranks[r]->Describe(),
                           dst, sp.model.params[piece.param].name,
                           engine.status());
        }
        routed[r].push_back(Routed{*engine, src.base, dst.base});
      }
    }
    for (size_t r = 0; r < layout.size(); ++r) {
      if (progress.cancel.load()) return absl::CancelledError("cancelled");
      batch.Clear();
      int64_t bytes = 0;
      for (size_t i = 0; i < layout[r].pieces.size(); ++i) {
        const Piece& piece = layout[r].pieces[i];
        const DType dtype = sp.model.params[piece.param].dtype;
        const Routed& to = routed[r][i];
        batch.Add(to.engine,
                  MakeCopy(to.src, piece, to.dst, piece, piece.box, dtype));
        bytes += BoxBytes(piece.box, dtype);
      }
      if (absl::Status s = router_.Run(batch); !s.ok()) {
        return NameMemoryFault(s);
      }
      progress.bytes_moved.fetch_add(bytes);
    }
    return absl::OkStatus();
  }

  const InstancePlan& ip = sp.DirectPlan(inst.plan_index);
  std::vector<Routed> routed;
  routed.reserve(ip.copies.size());
  for (const Copy& c : ip.copies) {
    const Participant& source = *sp.sources[c.src_rank];
    const Piece& src = sp.source_layouts[c.src_rank].pieces[c.src_piece];
    const Piece& dst = layout[c.dst_rank].pieces[c.dst_piece];
    BufferPlace from = PlaceIn(*source.memory, src.buffer);
    if (from.base == nullptr) return MissingBuffer(source.Describe(), src.buffer);
    BufferPlace to = job.destination[c.dst_rank].Find(dst.buffer);
    if (to.base == nullptr) {
      return MissingBuffer(inst.ranks[c.dst_rank]->Describe(), dst.buffer);
    }
    absl::StatusOr<CopyEngine*> engine = router_.EngineFor(from, to);
    if (!engine.ok()) {
      return MixedCopy(source.Describe(), from,
                       inst.ranks[c.dst_rank]->Describe(), to,
                       sp.model.params[c.param].name, engine.status());
    }
    routed.push_back(Routed{*engine, from.base, to.base});
  }
  for (const Bucket& bucket : ip.buckets) {
    if (progress.cancel.load()) return absl::CancelledError("cancelled");
    batch.Clear();
    for (int32_t k = bucket.first_copy;
         k < bucket.first_copy + bucket.num_copies; ++k) {
      const Copy& c = ip.copies[k];
      batch.Add(routed[k].engine,
                MakeCopy(routed[k].src,
                         sp.source_layouts[c.src_rank].pieces[c.src_piece],
                         routed[k].dst, layout[c.dst_rank].pieces[c.dst_piece],
                         ip.BoxOf(c, layout), sp.model.params[c.param].dtype));
    }
    if (absl::Status s = router_.Run(batch); !s.ok()) {
      return NameMemoryFault(s);
    }
    progress.bytes_moved.fetch_add(bucket.bytes);
  }
  return absl::OkStatus();
}

}  // namespace ferry
