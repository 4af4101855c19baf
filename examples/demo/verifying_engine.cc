#include "examples/demo/verifying_engine.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "examples/demo/weight_pattern.h"
#include "core/explain.h"
#include "core/models/engine_layout.h"
#include "core/region_copy.h"
#include "glog/logging.h"

namespace ferry {

absl::StatusOr<std::unique_ptr<VerifyingEngine>> VerifyingEngine::Create(
    const ModelSchema& schema, int tp, int tp_rank,
    const std::vector<std::string>& force_fallback,
    const std::string& arena_hint) {
  if (tp < 1 || tp_rank < 0 || tp_rank >= tp) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp rank ", tp_rank, " of tp ", tp));
  }
  EngineParallelism par;
  par.tp = tp;
  absl::StatusOr<std::vector<EngineTable>> tables =
      BuildEngineTables(schema.spec, schema.config, par);
  if (!tables.ok()) return tables.status();
  absl::StatusOr<ResolvedInstance> resolved =
      ResolveDestinationLayout(schema.spec, *tables);
  if (!resolved.ok()) return resolved.status();

  std::unique_ptr<VerifyingEngine> e(new VerifyingEngine(schema));
  int unverifiable = 0;
  for (const Piece& p : resolved->ranks[tp_rank].layout.pieces) {
    if (p.buffer & kStagingBufferBit) {
      ++unverifiable;
      continue;
    }
    e->live_pieces_.push_back(p);
    e->checked_bytes_ += BoxBytes(p.box, schema.spec.params[p.param].dtype);
  }
  if (unverifiable > 0) {
    LOG(WARNING) << unverifiable
                 << " pieces resolve to fallback even unforced; their live "
                    "bytes are not checked";
  }
  e->table_ = (*tables)[tp_rank];
  for (EngineParam& p : e->table_.params) {
    for (const std::string& s : force_fallback) {
      if (!s.empty() && absl::StrContains(p.name, s)) {
        p.flags |= kFlagTransformed;
        ++e->forced_;
        break;
      }
    }
  }
  const int64_t bytes =
      e->table_.buffer_bytes.empty() ? 0 : e->table_.buffer_bytes[0];
  absl::StatusOr<std::unique_ptr<SharedTensorArena>> arena =
      SharedTensorArena::Create(arena_hint, std::max<int64_t>(bytes, 1), 0);
  if (!arena.ok()) return arena.status();
  e->arena_ = *std::move(arena);
  // core/models placed the tensors (256-byte aligned, as the arena would);
  // claim the whole layout so the arena's books agree.
  if (bytes > 0) {
    absl::StatusOr<TensorSlot> slot = e->arena_->Allocate(bytes);
    if (!slot.ok()) return slot.status();
  }
  // The base weights (version 0), as if loaded from the checkpoint.
  for (const Piece& piece : e->live_pieces_) {
    FillPiece(0, schema.spec.params[piece.param], piece, e->arena_->data());
  }
  return e;
}

DestinationCallbacks VerifyingEngine::Callbacks() {
  DestinationCallbacks c;
  c.on_prepare = [](int64_t v) {
    LOG(INFO) << "PREPARE v" << v;
    return absl::OkStatus();
  };
  c.on_pause = [](int64_t v) {
    LOG(INFO) << "PAUSE v" << v << ": paused at a safe point";
    return absl::OkStatus();
  };
  c.on_apply = [this](int64_t v, const std::vector<FallbackTensorView>& t) {
    return OnApply(v, t);
  };
  c.on_commit = [this](int64_t v) { OnCommit(v); };
  c.on_abort = [this](int64_t v, const std::string& r, bool dirty) {
    OnAbort(v, r, dirty);
  };
  return c;
}

absl::Status VerifyingEngine::OnApply(
    int64_t v, const std::vector<FallbackTensorView>& tensors) {
  const ModelSpec& model = schema_.spec;
  for (const FallbackTensorView& t : tensors) {
    const int32_t id = model.Find(t.parameter);
    if (id < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fallback tensor ", t.parameter, " is not in the model"));
    }
    const ParamSpec& p = model.params[id];
    const int64_t need = Volume(StorageShape(p.shape, p.dtype)) * UnitBytes(p.dtype);
    if (static_cast<int64_t>(t.bytes.size()) != need || t.dtype != p.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(
          "fallback tensor ", t.parameter, " has ", t.bytes.size(),
          " bytes of dtype ", t.dtype == DType::kInvalid ? "?" : DTypeName(t.dtype),
          "; expected ", need, " bytes of ", DTypeName(p.dtype)));
    }
    const Piece whole = Piece::Contiguous(id, FullBox(p.shape), 0, 0, p.dtype);
    if (absl::Status s = CheckPiece(v, p, whole, t.bytes.data()); !s.ok()) {
      LOG(ERROR) << "MISMATCH in APPLY v" << v << " fallback " << s.message();
      absl::MutexLock lock(&mu_);
      ++mismatches_;
      return s;  // acks FAILED: the instance must not commit bad weights
    }
    // The "loader": this rank's share of the tensor into live memory.
    for (const Piece& live : live_pieces_) {
      if (live.param != id) continue;
      CopyBoxBetweenPieces(t.bytes.data(), whole, arena_->data(), live,
                           live.box, p.dtype);
    }
  }
  LOG(INFO) << "APPLY v" << v << ": " << tensors.size()
            << " fallback tensors checked and loaded";
  absl::MutexLock lock(&mu_);
  fallback_loaded_ += static_cast<int>(tensors.size());
  return absl::OkStatus();
}

absl::Status VerifyingEngine::VerifyLive(int64_t version) const {
  int bad = 0;
  std::string first;
  for (const Piece& piece : live_pieces_) {
    absl::Status s =
        CheckPiece(version, schema_.spec.params[piece.param], piece, arena_->data());
    if (!s.ok() && bad++ < 3) absl::StrAppend(&first, "\n  ", s.message());
  }
  if (bad == 0) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat(bad, " of ", live_pieces_.size(),
                                          " live pieces differ from version ",
                                          version, ":", first));
}

void VerifyingEngine::OnCommit(int64_t v) {
  const absl::Time start = absl::Now();
  absl::Status s = VerifyLive(v);
  if (s.ok()) {
    LOG(INFO) << "COMMIT v" << v << ": OK, " << live_pieces_.size()
              << " pieces (" << HumanBytes(checked_bytes_)
              << ") match, checked in " << absl::FormatDuration(absl::Now() - start);
  } else {
    LOG(ERROR) << "MISMATCH at COMMIT v" << v << ": " << s.message();
  }
  absl::MutexLock lock(&mu_);
  if (!s.ok()) ++mismatches_;
  committed_ = v;
}

void VerifyingEngine::OnAbort(int64_t v, const std::string& reason,
                              bool dirty) {
  LOG(WARNING) << "ABORT v" << v << (dirty ? " (dirty)" : " (clean)") << ": "
               << reason;
  absl::MutexLock lock(&mu_);
  ++aborts_;
}

int64_t VerifyingEngine::committed_version() const {
  absl::MutexLock lock(&mu_);
  return committed_;
}
int VerifyingEngine::mismatches() const {
  absl::MutexLock lock(&mu_);
  return mismatches_;
}
int VerifyingEngine::aborts() const {
  absl::MutexLock lock(&mu_);
  return aborts_;
}
int VerifyingEngine::fallback_tensors_loaded() const {
  absl::MutexLock lock(&mu_);
  return fallback_loaded_;
}

}  // namespace ferry
