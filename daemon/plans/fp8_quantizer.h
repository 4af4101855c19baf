// Fp8Quantizer: FP8 in flight's quantize step in ferryd (issue 40;
// docs/architecture.md, "FP8 in flight").
//
// Role: PlanCache turns the instances' quantized targets into derived
// parameters fed by quantizer ranks (core/fp8_sources.h, AddFp8Sources)
// and makes one of these per stream plan: it owns the quantizer ranks'
// memory (as source Participants the data path reads like a trainer
// rank's) and, once per version run, before the first transfer that reads
// them, assembles each quantized tensor from the trainer ranks' memory
// mapped on this node and quantizes it there (QuantizeParam). A quantizer
// rank on a member is only planned here: its memory is the member's, and
// the routes that read it carry its tensors to the member
// (RunTransferRequest.quantize, transfer_routes.h), which quantizes them
// (RouteQuantizers, daemon/transfer/route_quantizers.h).
//
// Owner: the StreamPlan (shared). Threading: thread-safe. Quantize runs on
// transfer workers: the first caller for a run quantizes, the others wait
// for it and get its status.
#ifndef FERRY_DAEMON_PLANS_FP8_QUANTIZER_H_
#define FERRY_DAEMON_PLANS_FP8_QUANTIZER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "core/fp8_sources.h"
#include "daemon/memory/gpu_reads.h"
#include "daemon/registry/participant.h"
#include "transport/device_memory.h"

namespace ferry {

class Fp8Quantizer {
 public:
  // `model` and `sources`: AddFp8Sources' (the stream plan's; they
  // outlive this). `trainer`: the trainer ranks' participants, by rank.
  // `node`: this daemon's; `devices` (not owned; may be null) reads
  // trainer ranks in GPU memory (GpuReads).
  Fp8Quantizer(const std::string& node, DeviceMemory* devices,
               const std::string& stream, const ModelSpec* model,
               const std::vector<RankLayout>* sources,
               std::vector<QuantizedParam> quantized,
               std::vector<std::shared_ptr<const Participant>> trainer);
  Fp8Quantizer(const Fp8Quantizer&) = delete;
  Fp8Quantizer& operator=(const Fp8Quantizer&) = delete;

  // The quantizer ranks, after the trainer's: the stream plan's sources.
  const std::vector<std::shared_ptr<const Participant>>& ranks() const {
    return ranks_;
  }
  const std::vector<QuantizedParam>& quantized() const { return quantized_; }
  // The tensor whose FP8 elements or scales are derived parameter
  // `param`, or null.
  const QuantizedParam* OfDerived(int32_t param) const;
  // Its trainer ranks' pieces (HeldPieces), by index into quantized().
  const std::vector<HeldPiece>& held(size_t i) const { return held_[i]; }

  // Every block's max |x| bits over the parts of split tensors `tensors`
  // (indices into quantized()) that member `node` holds, a grid per
  // tensor (Peer.BlockAmax, asked by the transfer queue).
  using RemoteAmax = std::function<absl::StatusOr<std::vector<std::vector<uint32_t>>>(
      const std::string& node, const std::vector<size_t>& tensors)>;

  // Quantizes every tensor quantized on this node for version run `run`
  // (VersionRun::serial), once; a later call for the same run returns the
  // first one's status. A split tensor's amaxes are first combined over
  // its parts here and on members (`remote`; null: an error where a member
  // holds parts), kept for the members' orders (CombinedAmax).
  // FAILED_PRECONDITION naming the tensor when its trainer ranks are not
  // all readable here (found once, when the plan is made); a client's
  // memory that went away is reported as the data path reports it.
  absl::Status Quantize(uint64_t run, const RemoteAmax& remote = nullptr)
      ABSL_LOCKS_EXCLUDED(mu_);

  // A run's combined max |x| bits, by tensor index (empty for a tensor
  // that is not split): as grids, and packed as the members' orders carry
  // them (PackMaxBits), packed once per run however many routes send them.
  struct Combined {
    std::vector<std::vector<uint32_t>> bits;
    std::vector<std::string> packed;
  };
  // Run `run`'s; null unless Quantize(run) succeeded.
  std::shared_ptr<const Combined> CombinedAmax(uint64_t run) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  using Grids = std::vector<std::vector<uint32_t>>;
  // The split tensors' grids combined over every holder.
  absl::StatusOr<Grids> CombineAmax(const RemoteAmax& remote) const;
  absl::Status QuantizeAll(const Grids& combined) const;
  // Runs `work` on tensor i's pieces as the CPU reads them (a GPU
  // trainer's read into host scratch first), under the memory fault guard.
  absl::Status OnHost(
      size_t i,
      const std::function<absl::Status(
          const std::vector<HeldPiece>&,
          const std::vector<std::vector<const uint8_t*>>&)>& work) const;

  const ModelSpec* const model_;
  const std::vector<RankLayout>* const sources_;
  const std::vector<QuantizedParam> quantized_;
  const std::vector<std::shared_ptr<const Participant>> trainer_;
  const std::string node_;
  std::vector<std::shared_ptr<const Participant>> ranks_;
  std::map<int32_t, size_t> of_derived_;  // derived param -> quantized_
  // Fixed with the plan: the trainer ranks' host memory mapped here (by
  // rank and buffer; null where not readable), each tensor's pieces, and
  // whether they cover it.
  std::vector<std::vector<const uint8_t*>> bases_;
  std::vector<const MemoryMap*> maps_;  // by trainer rank; null: not here
  std::unique_ptr<GpuReads> gpu_reads_;  // null: no GPU pieces to read
  std::vector<std::vector<HeldPiece>> held_;
  absl::Status readable_;

  mutable absl::Mutex mu_;
  bool busy_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t run_ ABSL_GUARDED_BY(mu_) = 0;  // the run last quantized for
  absl::Status status_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<const Combined> combined_ ABSL_GUARDED_BY(mu_);
};

}  // namespace ferry

#endif  // FERRY_DAEMON_PLANS_FP8_QUANTIZER_H_
