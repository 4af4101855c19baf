#include "daemon/plans/fp8_quantizer.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/fp8_split.h"
#include "core/parallel_for.h"
#include "daemon/memory/memory_map.h"

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
    const QuantizedParam& q = quantized_[i];
    if (!q.QuantizedOn(node_)) continue;
    if (readable_.ok()) {
      readable_ = q.split() ? CheckPartsReadable(*model_, q, node_, held_[i],
                                                 readable)
                            : CheckReadable(*model_, q, held_[i], readable);
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

absl::Status Fp8Quantizer::Quantize(uint64_t run, const RemoteAmax& remote) {
  {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](bool* busy) { return !*busy; }, &busy_));
    if (done_ && run_ == run) return status_;
    busy_ = true;
  }
  std::shared_ptr<Combined> combined;
  absl::Status s = readable_;
  if (s.ok()) {
    absl::StatusOr<Grids> grids = CombineAmax(remote);
    s = grids.status();
    if (grids.ok()) {
      combined = std::make_shared<Combined>();
      combined->bits = *std::move(grids);
      for (const std::vector<uint32_t>& g : combined->bits) {
        combined->packed.push_back(g.empty() ? std::string() : PackMaxBits(g));
      }
    }
  }
  if (s.ok()) s = QuantizeAll(combined->bits);
  absl::MutexLock lock(&mu_);
  busy_ = false;
  done_ = true;
  run_ = run;
  status_ = s;
  combined_ = s.ok() ? std::move(combined) : nullptr;
  return s;
}

std::shared_ptr<const Fp8Quantizer::Combined> Fp8Quantizer::CombinedAmax(
    uint64_t run) const {
  absl::MutexLock lock(&mu_);
  return done_ && run_ == run ? combined_ : nullptr;
}

absl::Status Fp8Quantizer::OnHost(
    size_t i,
    const std::function<absl::Status(
        const std::vector<HeldPiece>&,
        const std::vector<std::vector<const uint8_t*>>&)>& work) const {
  return RunOnHostPieces(gpu_reads_.get(), held_[i], bases_, maps_,
                         model_->params[quantized_[i].param].dtype, work);
}

absl::StatusOr<Fp8Quantizer::Grids> Fp8Quantizer::CombineAmax(
    const RemoteAmax& remote) const {
  Grids grids(quantized_.size());
  std::map<std::string, std::vector<size_t>> on_members;  // node -> tensors
  std::vector<size_t> here;
  for (size_t i = 0; i < quantized_.size(); ++i) {
    const QuantizedParam& q = quantized_[i];
    if (!q.split()) continue;
    const Dims& grid = model_->params[q.scale_param].shape;
    grids[i].assign(static_cast<size_t>(grid[0] * grid[1]), 0u);
    std::set<std::string> nodes;
    for (const QuantizedPart& p : q.parts) nodes.insert(p.node);
    for (const std::string& n : nodes) {
      if (n == node_) {
        here.push_back(i);
      } else {
        on_members[n].push_back(i);
      }
    }
  }
  // The members' (a call each, side by side) and this node's.
  std::vector<std::string> members;
  for (const auto& [n, tensors] : on_members) members.push_back(n);
  std::vector<absl::StatusOr<Grids>> theirs(members.size());
  ParallelFor(members.size(), PlanningThreads(), [&](size_t k) {
    theirs[k] = remote == nullptr
                    ? absl::UnavailableError("no way to reach members")
                    : remote(members[k], on_members[members[k]]);
  });
  std::vector<absl::Status> status(here.size());
  Grids mine(here.size());
  ParallelFor(here.size(), PlanningThreads(), [&](size_t k) {
    mine[k].assign(grids[here[k]].size(), 0u);
    status[k] = OnHost(here[k], [&](const std::vector<HeldPiece>& held,
                                    const std::vector<std::vector<const uint8_t*>>& bases) {
      return PartialAmax(*model_, quantized_[here[k]], node_, held, bases,
                         mine[k].data());
    });
  });
  auto raise = [](std::vector<uint32_t>& to, const std::vector<uint32_t>& from) {
    for (size_t b = 0; b < to.size(); ++b) to[b] = std::max(to[b], from[b]);
  };
  for (size_t k = 0; k < here.size(); ++k) {
    if (!status[k].ok()) return status[k];
    raise(grids[here[k]], mine[k]);
  }
  for (size_t k = 0; k < members.size(); ++k) {
    if (!theirs[k].ok()) {
      return absl::Status(theirs[k].status().code(),
                          absl::StrCat("block amaxes of split tensors from ",
                                       members[k], ": ",
                                       theirs[k].status().message()));
    }
    const std::vector<size_t>& tensors = on_members[members[k]];
    if (theirs[k]->size() != tensors.size()) {
      return absl::DataLossError(absl::StrCat(
          members[k], " answered block amaxes for ", theirs[k]->size(),
          " tensors, not ", tensors.size()));
    }
    for (size_t t = 0; t < tensors.size(); ++t) {
      const std::vector<uint32_t>& g = (*theirs[k])[t];
      if (g.size() != grids[tensors[t]].size()) {
        return absl::DataLossError(absl::StrCat(
            members[k], " answered ", g.size(), " block amaxes for ",
            model_->params[quantized_[tensors[t]].param].name, ", not ",
            grids[tensors[t]].size()));
      }
      raise(grids[tensors[t]], g);
    }
  }
  return grids;
}

absl::Status Fp8Quantizer::QuantizeAll(const Grids& combined) const {
  // Tensors side by side (each writes its own bytes); the first error in
  // tensor order is the answer.
  std::vector<absl::Status> status(quantized_.size());
  ParallelFor(quantized_.size(), PlanningThreads(), [&](size_t i) {
    const QuantizedParam& q = quantized_[i];
    if (!q.QuantizedOn(node_)) return;  // its members quantize it
    // Where this node's quantizer rank is: the tensor's own, or the rank
    // of its parts here.
    int32_t rank = q.source_rank;
    for (const QuantizedPart& p : q.parts) {
      if (p.node == node_) rank = p.source_rank;
    }
    const MemoryMap& out = *ranks_[rank - trainer_.size()]->memory;
    status[i] = OnHost(i, [&](const std::vector<HeldPiece>& held,
                              const std::vector<std::vector<const uint8_t*>>& bases) {
      if (!q.split()) {
        return QuantizeParam(*model_, q, held, bases, out.base(0), out.base(1));
      }
      return QuantizeParts(*model_, q, node_, held, bases, combined[i].data(),
                           out.base(0),
                           q.node == node_ ? out.base(1) : nullptr);
    });
  });
  for (absl::Status& s : status) {
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

}  // namespace ferry
