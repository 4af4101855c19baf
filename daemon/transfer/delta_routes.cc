#include "daemon/transfer/delta_routes.h"

#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "core/piece.h"
#include "transport/bucket_patch.h"
#include "transport/memory_fault_guard.h"

namespace ferry {
namespace {

constexpr uint64_t kFormBucketBit = uint64_t{1} << 63;
constexpr int64_t kFormBytes = 16;
constexpr uint64_t kDense = 0, kPatch = 1;

// One contiguous buffer as a bucket of its own.
BucketView Flat(uint64_t id, uint8_t* data, int64_t bytes) {
  BucketView v;
  v.id = id;
  v.regions.push_back(RegionView{data, {1}});
  v.extents.push_back({bytes});
  v.unit_bytes.push_back(1);
  v.bytes = bytes;
  return v;
}

}  // namespace

void DeltaCounts::AddTo(v1::RunTransferResponse* response) const {
  v1::DeltaBytes* d = response->mutable_delta();
  d->set_dense_bytes(d->dense_bytes() + dense_bytes.load());
  d->set_patched_bytes(d->patched_bytes() + patched_bytes.load());
  d->set_patch_bytes(d->patch_bytes() + patch_bytes.load());
  d->set_changed_bytes(d->changed_bytes() + changed_bytes.load());
}

void DeltaCounts::Patched(int64_t bucket_bytes, int64_t patch,
                          int64_t changed_chunks) {
  patched_bytes += bucket_bytes;
  patch_bytes += patch;
  changed_bytes += changed_chunks * kPatchChunkBytes;
}

DeltaSender::DeltaSender(DeltaShadows* shadows,
                         const v1::RunTransferRequest& receiver,
                         const std::vector<BucketView>& views,
                         const std::vector<std::vector<BufferPlace>>& places,
                         DeltaCounts* counts)
    : shadows_(shadows),
      receiver_(receiver),
      version_(receiver.version()),
      base_(receiver.delta_base()),
      views_(views),
      places_(places),
      counts_(counts) {}

absl::Status DeltaSender::Send(Channel& channel, size_t i,
                               absl::Time deadline) const {
  const BucketView& view = views_[i];
  // Every box's buffer's changes in this version (which also brings the
  // shadows to it), and whether a patch is exact here.
  std::vector<DeltaShadows::Changes> held;
  std::vector<ChunkChanges> changes;
  std::vector<const uint8_t*> bases;
  bool exact = base_ > 0 && i < places_.size() &&
               places_[i].size() == view.regions.size() &&
               static_cast<int>(i) < receiver_.receive_size() &&
               receiver_.receive(i).boxes_size() ==
                   static_cast<int>(view.regions.size());
  // Staging (a fallback tensor's) holds no previous version to patch.
  for (int k = 0; exact && k < receiver_.receive(i).boxes_size(); ++k) {
    exact = !(receiver_.receive(i).boxes(k).buffer() & kStagingBufferBit);
  }
  for (size_t k = 0; k < view.regions.size(); ++k) {
    const BufferPlace* place =
        i < places_.size() && k < places_[i].size() ? &places_[i][k] : nullptr;
    DeltaShadows::Changes c;
    if (place != nullptr && place->map != nullptr) {
      c = shadows_->For(place->map, place->index, version_);
    }
    exact = exact && c.since == base_ && c.bits != nullptr;
    bases.push_back(c.buffer_base);
    changes.push_back(ChunkChanges{c.buffer_base, c.bits ? c.bits->data() : nullptr});
    held.push_back(std::move(c));
  }
  uint64_t form[2] = {kDense, 0};
  PatchPlan plan;
  if (exact && Patchable(view, bases)) {
    plan = PlanPatch(view, changes, view.bytes);
    if (!plan.dense) form[0] = kPatch, form[1] = plan.bytes;
  }
  std::vector<uint8_t> patch;
  if (form[0] == kPatch) {
    patch.resize(plan.bytes);
    absl::Status written =
        RunGuarded([&] { WritePatch(view, plan, patch.data()); });
    if (!written.ok()) return written;
  }
  absl::Status s = channel.Send(
      Flat(view.id ^ kFormBucketBit, reinterpret_cast<uint8_t*>(form),
           kFormBytes),
      deadline);
  if (!s.ok()) return s;
  if (form[0] == kDense) {
    s = channel.Send(view, deadline);
    if (s.ok()) counts_->dense_bytes += view.bytes;
    return s;
  }
  s = channel.Send(Flat(view.id, patch.data(), plan.bytes), deadline);
  if (s.ok()) counts_->Patched(view.bytes, plan.bytes, plan.changed_chunks);
  return s;
}

absl::Status ReceiveDelta(Channel& channel, const BucketView& view,
                          absl::Time deadline, DeltaCounts* counts,
                          const std::string& what) {
  uint64_t form[2] = {0, 0};
  absl::Status s = channel.Receive(
      Flat(view.id ^ kFormBucketBit, reinterpret_cast<uint8_t*>(form),
           kFormBytes),
      deadline);
  if (!s.ok()) return s;
  if (form[0] == kDense) {
    s = channel.Receive(view, deadline);
    if (s.ok()) counts->dense_bytes += view.bytes;
    return s;
  }
  const std::string bucket = absl::StrCat(what, " bucket ", view.id);
  // A patch is smaller than its bucket, or it would have come dense.
  if (form[0] != kPatch || form[1] == 0 ||
      form[1] >= static_cast<uint64_t>(view.bytes)) {
    return absl::DataLossError(absl::StrCat(
        bucket, ": form ", form[0], " of ", form[1], " bytes for a bucket of ",
        view.bytes));
  }
  const int64_t bytes = static_cast<int64_t>(form[1]);
  std::vector<uint8_t> patch(bytes);
  s = channel.Receive(Flat(view.id, patch.data(), bytes), deadline);
  if (!s.ok()) return s;
  absl::StatusOr<ParsedPatch> parsed =
      ParsePatch(view, patch.data(), bytes, bucket);
  if (!parsed.ok()) return parsed.status();
  s = RunGuarded([&] { ApplyPatch(view, *parsed, patch.data()); });
  if (!s.ok()) return s;
  int64_t changed = 0;
  for (const ParsedPatch::Box& b : parsed->boxes) changed += b.count;
  counts->Patched(view.bytes, bytes, changed);
  return absl::OkStatus();
}

}  // namespace ferry
