#include "daemon/plans/fp8_quantizer.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/parallel_for.h"
#include "daemon/memory/memory_map.h"
#include "transport/memory_fault_guard.h"

namespace ferry {

Fp8Quantizer::Fp8Quantizer(
    const std::string& node, const std::string& stream, const ModelSpec* model,
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
  // A trainer rank on a member, or in GPU memory, is not readable here.
  bases_.resize(trainer_.size());
  for (size_t r = 0; r < trainer_.size(); ++r) {
    const Participant* p = trainer_[r].get();
    if (p == nullptr || p->memory == nullptr || !p->memory->mapped()) continue;
    for (size_t b = 0; b < p->memory->size(); ++b) {
      bases_[r].push_back(p->memory->on_device(b) ? nullptr
                                                  : p->memory->base(b));
    }
  }
  held_ = HeldPieces(quantized_, *sources_);
  for (size_t i = 0; i < quantized_.size(); ++i) {
    of_derived_[quantized_[i].fp8_param] = i;
    of_derived_[quantized_[i].scale_param] = i;
    if (readable_.ok() && quantized_[i].node == node_) {
      readable_ = CheckReadable(*model_, quantized_[i], held_[i], bases_);
    }
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
    absl::Status guarded = RunGuarded([&] {
      status[i] = QuantizeParam(*model_, q, held_[i], bases_, out.base(0),
                                out.base(1));
    });
    if (!guarded.ok()) status[i] = NameMemoryFault(guarded);
  });
  for (absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace ferry
