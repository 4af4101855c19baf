#include "daemon/plans/fp8_quantizer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/parallel_for.h"
#include "daemon/memory/memory_map.h"
#include "transport/memory_fault_guard.h"

namespace ferry {

Fp8Quantizer::Fp8Quantizer(
    const std::string& node, DeviceMemory* devices, const std::string& stream,
    const ModelSpec* model,
    const std::vector<RankLayout>* sources,
    std::vector<QuantizedParam> quantized,
    std::vector<std::shared_ptr<const Participant>> trainer)
    : model_(model),
      sources_(sources),
      quantized_(std::move(quantized)),
      trainer_(std::move(trainer)),
      node_(node) {
  for (size_t r = trainer_.size(); r < sources_->size(); ++r) {
    const RankLayout& layout = (*sources_)[r];
    auto p = std::make_shared<Participant>();
    p->id = absl::StrCat("quantizer.", stream, ".", layout.node);
    p->role = Role::kSource;
    p->stream = stream;
    p->node = layout.node;
    p->rank = static_cast<int32_t>(r);
    p->world_size = static_cast<int32_t>(trainer_.size());
    p->memory = layout.node == node_
                    ? MemoryMap::OwnedHost(layout.buffer_bytes)
                    : MemoryMap::HostElsewhere(layout.buffer_bytes);
    ranks_.push_back(std::move(p));
  }
  // A trainer rank on a member is not readable here; one in GPU memory is
  // read through the host (GpuReads) where this daemon has GPUs.
  bases_.resize(trainer_.size());
  maps_.resize(trainer_.size(), nullptr);
  for (size_t r = 0; r < trainer_.size(); ++r) {
    const Participant* p = trainer_[r].get();
    if (p == nullptr || p->memory == nullptr || !p->memory->mapped()) continue;
    maps_[r] = p->memory.get();
    for (size_t b = 0; b < p->memory->size(); ++b) {
      bases_[r].push_back(p->memory->on_device(b) ? nullptr
                                                  : p->memory->base(b));
    }
  }
  const bool gpus = devices != nullptr && devices->Available().ok();
  const auto readable = [&](const HeldPiece& h) {
    const size_t r = static_cast<size_t>(h.rank);
    const MemoryMap* m = r < maps_.size() ? maps_[r] : nullptr;
    if (m == nullptr || h.piece->buffer >= m->size()) return false;
    return !m->on_device(h.piece->buffer) || gpus;
  };
  held_ = HeldPieces(quantized_, *sources_);
  int64_t gpu_bytes = 0;
  int gpu_tensors = 0;
  for (size_t i = 0; i < quantized_.size(); ++i) {
    of_derived_[quantized_[i].fp8_param] = i;
    of_derived_[quantized_[i].scale_param] = i;
    if (quantized_[i].node != node_) continue;
    if (readable_.ok()) {
      readable_ = CheckReadable(*model_, quantized_[i], held_[i], readable);
    }
    const int64_t g = GpuReads::GpuBytes(
        held_[i], maps_, model_->params[quantized_[i].param].dtype);
    gpu_bytes = std::max(gpu_bytes, g);
    gpu_tensors += g > 0;
  }
  if (gpu_bytes > 0 && gpus) {
    gpu_reads_ = std::make_unique<GpuReads>(
        devices, gpu_bytes, std::min(gpu_tensors, PlanningThreads()));
  }
}

const QuantizedParam* Fp8Quantizer::OfDerived(int32_t param) const {
  auto it = of_derived_.find(param);
  return it == of_derived_.end() ? nullptr : &quantized_[it->second];
}

absl::Status Fp8Quantizer::Quantize(uint64_t run) {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](bool* busy) { return !*busy; }, &busy_));
    if (done_ && run_ == run) return status_;
    busy_ = true;
  }
  absl::Status s = QuantizeAll();
  absl::MutexLock lock(&mu_);
  busy_ = false;
  done_ = true;
  run_ = run;
  status_ = s;
  return s;
}

absl::Status Fp8Quantizer::QuantizeAll() const {
  if (!readable_.ok()) return readable_;
  // Tensors side by side (each writes its own bytes); the first error in
  // tensor order is the answer.
  std::vector<absl::Status> status(quantized_.size());
  ParallelFor(quantized_.size(), PlanningThreads(), [&](size_t i) {
    const QuantizedParam& q = quantized_[i];
    if (q.node != node_) return;  // its member quantizes it
    const MemoryMap& out = *ranks_[q.source_rank - trainer_.size()]->memory;
    // A GPU trainer's pieces: read into host scratch first.
    std::unique_ptr<GpuReads::Host> host;
    if (gpu_reads_ != nullptr) {
      absl::StatusOr<std::unique_ptr<GpuReads::Host>> read = gpu_reads_->Read(
          held_[i], bases_, maps_, model_->params[q.param].dtype);
      if (!read.ok()) {
        status[i] = read.status();
        return;
      }
      host = *std::move(read);
    }
    absl::Status guarded = RunGuarded([&] {
      status[i] = host != nullptr
                      ? QuantizeParam(*model_, q, host->held(), host->bases(),
                                      out.base(0), out.base(1))
                      : QuantizeParam(*model_, q, held_[i], bases_,
                                      out.base(0), out.base(1));
    });
    if (!guarded.ok()) status[i] = NameMemoryFault(guarded);
  });
  for (absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace ferry
