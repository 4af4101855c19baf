#include "daemon/transfer/transfer_checksums.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/limits.h"
#include "core/region_copy.h"
#include "daemon/plans/fp8_quantizer.h"
#include "daemon/transfer/box_hash.h"
#include "proto/convert.h"

namespace ferry {
namespace {

// Boxes per Peer.HashBoxes call: keeps requests and responses far below
// gRPC's message limits on models with millions of copies (and within the
// member's request limit).
constexpr int64_t kBoxesPerCall = Limits::kMaxBoxesPerHashCall;
const char kFallbackReason[] =
    "not verifiable (fallback): assembled in staging and handed to the "
    "engine's loader, which ferryd does not see";
const char kDestinationGpuReason[] =
    "not verified: GPU memory (engine rank; ferryd hashes host memory only)";

// Interns reasons: index 0 is "" (hashed).
uint16_t ReasonCode(InstanceChecksums::Hashes* h, const std::string& why) {
  for (size_t i = 1; i < h->reasons.size(); ++i) {
    if (h->reasons[i] == why) return static_cast<uint16_t>(i);
  }
  if (h->reasons.size() >= 0xffff) return static_cast<uint16_t>(0xfffe);
  h->reasons.push_back(why);
  return static_cast<uint16_t>(h->reasons.size() - 1);
}

v1::TransferBox WireBox(const std::string& participant_id, uint32_t buffer,
                        const Piece& piece, const Box& box, DType dtype) {
  v1::TransferBox b;
  b.set_participant_id(participant_id);
  b.set_buffer(buffer);
  b.set_byte_offset(ByteOffsetOf(piece, box, dtype));
  for (int64_t s : piece.strides) b.add_strides(s);
  for (int64_t e : StorageBox(box, dtype).extent) b.add_extent(e);
  b.set_unit_bytes(UnitBytes(dtype));
  return b;
}

// Boxes on another node, and which slot of the caller's each answers.
struct RemoteBoxes {
  std::vector<v1::TransferBox> boxes;
  std::vector<int64_t> slot;
};

// Asks each node for its boxes' hashes; calls done(slot, hash, why) per
// box (why non-empty: not hashed).
void HashRemote(
    RemoteBoxHasher* remote, const std::string& self,
    std::map<std::string, RemoteBoxes>& by_node,
    const std::function<void(int64_t, uint64_t, const std::string&)>& done,
    absl::Status* error) {
  for (auto& [node, rb] : by_node) {
    for (size_t first = 0; first < rb.boxes.size(); first += kBoxesPerCall) {
      const size_t last = std::min(rb.boxes.size(), first + kBoxesPerCall);
      absl::StatusOr<v1::HashBoxesResponse> resp;
      if (remote == nullptr) {
        resp = absl::UnimplementedError("no peer to ask");
      } else {
        v1::HashBoxesRequest req;
        req.set_caller_node(self);
        for (size_t i = first; i < last; ++i) *req.add_boxes() = rb.boxes[i];
        resp = remote->HashBoxes(node, req);
        if (resp.ok() &&
            resp->boxes_size() != static_cast<int>(last - first)) {
          resp = absl::InternalError(absl::StrCat(
              "node ", node, " answered ", resp->boxes_size(),
              " checksums for ", last - first, " boxes"));
        }
      }
      for (size_t i = first; i < last; ++i) {
        if (!resp.ok()) {
          if (error != nullptr && error->ok()) *error = resp.status();
          done(rb.slot[i], 0,
               absl::StrCat("not hashed: node ", node, ": ",
                            resp.status().message()));
          continue;
        }
        const v1::BoxChecksum& c = resp->boxes(i - first);
        done(rb.slot[i], c.hash(),
             c.unhashable().empty()
                 ? std::string()
                 : absl::StrCat("not verified: ", c.unhashable(), " (node ",
                                node, ")"));
      }
    }
  }
}

// The boxes of one checksum pass, by slot (a copy's index in the plan):
// those in memory mapped here are hashed on this daemon's threads, the
// others by the node that maps them (Peer.HashBoxes). Both passes (the
// sources at transfer time, the destinations in VerifyInstance) use it.
class BoxHashSet {
 public:
  // The box `box` of `piece` (a piece of `who`'s memory `map`).
  void Add(int64_t slot, const Participant& who, const MemoryMap& map,
           const Piece& piece, const Box& box, DType dtype, int64_t bytes) {
    if (map.mapped()) {
      local_.push_back(LocalBox{map.base(piece.buffer) +
                                    ByteOffsetOf(piece, box, dtype),
                                &piece.strides, StorageBox(box, dtype).extent,
                                UnitBytes(dtype), bytes});
      local_slot_.push_back(slot);
    } else {
      RemoteBoxes& rb = remote_[who.node];
      rb.boxes.push_back(WireBox(who.id, piece.buffer, piece, box, dtype));
      rb.slot.push_back(slot);
    }
  }

  // Hashes every box and calls done(slot, hash, why) for each (why
  // non-empty: not hashed). `cancel` set: stops early (hashes unused).
  // `error`: the first remote error, if any.
  void Hash(RemoteBoxHasher* remote, const std::string& self, int threads,
            const std::atomic<bool>* cancel,
            const std::function<void(int64_t, uint64_t, const std::string&)>&
                done,
            absl::Status* error) {
    std::vector<uint64_t> hashes;
    std::vector<char> faulted;
    HashLocal(local_, threads, &hashes, &faulted, cancel);
    for (size_t i = 0; i < hashes.size(); ++i) {
      done(local_slot_[i], hashes[i],
           faulted[i] ? std::string(kUnbackedReason) : std::string());
    }
    HashRemote(remote, self, remote_, done, error);
  }

 private:
  std::vector<LocalBox> local_;
  std::vector<int64_t> local_slot_;
  std::map<std::string, RemoteBoxes> remote_;
};

}  // namespace

TransferChecksums::Pending::~Pending() {
  if (thread_.joinable()) thread_.join();
}

std::shared_ptr<const InstanceChecksums> TransferChecksums::Pending::Finish(
    bool transferred) {
  if (thread_.joinable()) thread_.join();
  if (hashes_ != nullptr) {
    if (transferred && job_.plan->fp8 != nullptr) {
      owner_->HashSources(job_, /*after_transfer=*/true, hashes_.get());
    }
    result_->hashes = std::move(hashes_);
  }
  return result_;
}

TransferChecksums::TransferChecksums(Options options)
    : options_(std::move(options)) {}

int TransferChecksums::threads() const {
  return options_.threads > 0 ? options_.threads : DefaultHashThreads();
}

std::unique_ptr<TransferChecksums::Pending> TransferChecksums::Start(
    const TransferJob& job, const std::string& stream, int64_t version,
    const std::string& instance,
    std::shared_ptr<const InstanceChecksums> relayed) const {
  if (!options_.enabled) return nullptr;
  auto pending = std::make_unique<Pending>();
  if (job.relay) {
    if (relayed != nullptr) {
      auto sums = std::make_shared<InstanceChecksums>(*relayed);
      sums->instance = instance;
      sums->planned = job.instance;
      sums->relayed_from = relayed->instance;
      pending->result_ = std::move(sums);
    }
    return pending;
  }
  auto sums = std::make_shared<InstanceChecksums>();
  sums->stream = stream;
  sums->instance = instance;
  sums->version = version;
  sums->plan = job.plan;
  sums->planned = job.instance;
  sums->copies_of = job.plan->instances[job.instance].plan_index;
  pending->result_ = sums;
  pending->owner_ = this;
  pending->job_ = job;
  pending->hashes_ = std::make_shared<InstanceChecksums::Hashes>();
  // The job's plan and the sources' maps are shared_ptrs the job holds;
  // the thread keeps its own copy of the job.
  pending->thread_ = std::thread([this, job, hashes = pending->hashes_] {
    HashSources(job, /*after_transfer=*/false, hashes.get());
  });
  return pending;
}

void TransferChecksums::HashSources(const TransferJob& job,
                                    bool after_transfer,
                                    InstanceChecksums::Hashes* out) const {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& inst = sp.instances[job.instance];
  const std::vector<RankLayout>& layout = *inst.layout;
  const InstancePlan& ip = sp.DirectPlan(inst.plan_index);
  const size_t n = ip.copies.size();
  if (!after_transfer) {
    out->hash.assign(n, 0);
    out->reason.assign(n, 0);
    out->reasons.assign(1, std::string());
  }
  // A member's quantizer rank (FP8 in flight) holds this run's bytes only
  // once the member has quantized them, during the transfer.
  const auto quantized_later = [&](const Participant& source) {
    if (sp.fp8 == nullptr || source.node == options_.node) return false;
    for (const auto& q : sp.fp8->ranks()) {
      if (q.get() == &source) return true;
    }
    return false;
  };

  BoxHashSet boxes;
  for (size_t k = 0; k < n; ++k) {
    const Copy& c = ip.copies[k];
    if (quantized_later(*sp.sources[c.src_rank]) != after_transfer) continue;
    const Piece& dst = layout[c.dst_rank].pieces[c.dst_piece];
    const Participant& rank = *inst.ranks[c.dst_rank];
    if (dst.buffer & kStagingBufferBit) {
      out->reason[k] = ReasonCode(out, kFallbackReason);
      continue;
    }
    if (rank.memory != nullptr && dst.buffer < rank.memory->size() &&
        rank.memory->on_device(dst.buffer)) {
      out->reason[k] = ReasonCode(out, kDestinationGpuReason);
      continue;
    }
    const Participant& source = *sp.sources[c.src_rank];
    const Piece& src = sp.source_layouts[c.src_rank].pieces[c.src_piece];
    const MemoryMap& map = *source.memory;
    if (src.buffer < map.size() && map.on_device(src.buffer)) {
      out->reason[k] = ReasonCode(
          out, absl::StrCat("not verified: GPU memory (source rank ",
                            source.rank, "; ferryd hashes host memory only)"));
      continue;
    }
    boxes.Add(static_cast<int64_t>(k), source, map, src, ip.BoxOf(c, layout),
              sp.model.params[c.param].dtype, c.bytes);
  }
  // An aborted transfer's checksums are never kept: stop hashing then.
  boxes.Hash(options_.remote, options_.node, threads(),
             job.progress == nullptr ? nullptr : &job.progress->cancel,
             [&](int64_t k, uint64_t h, const std::string& why) {
               out->hash[k] = h;
               if (!why.empty()) out->reason[k] = ReasonCode(out, why);
             },
             nullptr);
}

void TransferChecksums::Commit(
    const std::string& instance, int64_t version,
    std::shared_ptr<const InstanceChecksums> checksums) {
  absl::MutexLock lock(&mu_);
  // Sets of instances whose ranks left are dropped (instances come and go;
  // each set holds its plan).
  for (auto it = kept_.begin(); it != kept_.end();) {
    bool gone = false;
    for (const auto& rank : it->second->plan->instances[it->second->planned].ranks) {
      gone = gone || rank->removed.load();
    }
    it = gone ? kept_.erase(it) : std::next(it);
  }
  if (checksums == nullptr || checksums->hashes == nullptr ||
      checksums->version != version) {
    kept_.erase(instance);
    return;
  }
  kept_[instance] = std::move(checksums);
}

std::shared_ptr<const InstanceChecksums> TransferChecksums::Latest(
    const std::string& instance) const {
  absl::MutexLock lock(&mu_);
  auto it = kept_.find(instance);
  return it == kept_.end() ? nullptr : it->second;
}

absl::StatusOr<v1::VerifyInstanceResponse> TransferChecksums::Verify(
    const InstanceChecksums& sums) const {
  const StreamPlan& sp = *sums.plan;
  const PlannedInstance& inst = sp.instances[sums.planned];
  const std::vector<RankLayout>& layout = *inst.layout;
  const InstancePlan& ip = sp.DirectPlan(sums.copies_of);
  const InstanceChecksums::Hashes& expected = *sums.hashes;
  for (const auto& rank : inst.ranks) {
    if (rank->removed.load()) {
      return absl::FailedPreconditionError(absl::StrCat(
          rank->Describe(), " (participant ", rank->id,
          ") has left since version ", sums.version,
          " was delivered; the checksums describe memory it no longer "
          "holds"));
    }
  }

  v1::VerifyInstanceResponse out;
  out.set_instance_id(sums.instance);
  out.set_stream(sums.stream);
  out.set_version(sums.version);
  out.set_algorithm("xxh3_64");
  out.set_relayed_from(sums.relayed_from);

  const size_t n = ip.copies.size();
  std::vector<uint64_t> actual(n, 0);
  // 0: compared; else why not (an index into `reasons`).
  InstanceChecksums::Hashes state;
  state.reason.assign(n, 0);
  state.reasons.assign(1, std::string());
  BoxHashSet boxes;
  for (size_t k = 0; k < n; ++k) {
    const Copy& c = ip.copies[k];
    if (expected.reason[k] != 0) {
      state.reason[k] = ReasonCode(&state, expected.reasons[expected.reason[k]]);
      continue;
    }
    const Piece& dst = layout[c.dst_rank].pieces[c.dst_piece];
    const Participant& rank = *inst.ranks[c.dst_rank];
    const MemoryMap& map = *rank.memory;
    if (dst.buffer & kStagingBufferBit) {
      state.reason[k] = ReasonCode(&state, kFallbackReason);
      continue;
    }
    if (dst.buffer >= map.size()) {
      return absl::InternalError(absl::StrCat(
          rank.Describe(), ": buffer ", dst.buffer, " is not registered"));
    }
    if (map.on_device(dst.buffer)) {
      state.reason[k] = ReasonCode(&state, kDestinationGpuReason);
      continue;
    }
    boxes.Add(static_cast<int64_t>(k), rank, map, dst, ip.BoxOf(c, layout),
              sp.model.params[c.param].dtype, c.bytes);
  }
  absl::Status remote_error;
  boxes.Hash(options_.remote, options_.node, threads(), nullptr,
             [&](int64_t k, uint64_t h, const std::string& why) {
               actual[k] = h;
               if (!why.empty()) state.reason[k] = ReasonCode(&state, why);
             },
             &remote_error);
  if (!remote_error.ok() && absl::IsUnavailable(remote_error)) {
    return remote_error;
  }

  std::set<int32_t> params;
  std::map<std::tuple<int32_t, int32_t, uint16_t>, int64_t> unverified;
  for (size_t k = 0; k < n; ++k) {
    const Copy& c = ip.copies[k];
    if (state.reason[k] != 0) {
      unverified[{c.dst_rank, c.param, state.reason[k]}] += c.bytes;
      out.set_bytes_unverifiable(out.bytes_unverifiable() + c.bytes);
      continue;
    }
    params.insert(c.param);
    out.set_boxes_checked(out.boxes_checked() + 1);
    out.set_bytes_checked(out.bytes_checked() + c.bytes);
    if (actual[k] == expected.hash[k]) continue;
    const Participant& rank = *inst.ranks[c.dst_rank];
    v1::ChecksumMismatch* m = out.add_mismatches();
    m->set_parameter(sp.model.params[c.param].name);
    m->set_tp_rank(rank.tp_rank);
    *m->mutable_box() = BoxToProto(ip.BoxOf(c, layout));
    m->set_expected(expected.hash[k]);
    m->set_actual(actual[k]);
    m->set_node(rank.node);
  }
  out.set_parameters_checked(static_cast<int64_t>(params.size()));
  for (const auto& [key, bytes] : unverified) {
    v1::UnverifiedParameter* u = out.add_unverifiable();
    u->set_parameter(sp.model.params[std::get<1>(key)].name);
    u->set_tp_rank(inst.ranks[std::get<0>(key)]->tp_rank);
    u->set_reason(state.reasons[std::get<2>(key)]);
    u->set_bytes(bytes);
  }
  return out;
}

absl::Status HashMappedBoxes(
    const v1::HashBoxesRequest& request,
    const std::function<std::shared_ptr<const MemoryMap>(const std::string&)>&
        memory_of,
    int threads, v1::HashBoxesResponse* response) {
  // Every box is checked before any is hashed; the maps are held until done.
  std::map<std::string, std::shared_ptr<const MemoryMap>> maps;
  std::vector<LocalBox> local;
  std::vector<int64_t> local_slot;
  std::vector<Dims> strides(request.boxes_size());
  for (int i = 0; i < request.boxes_size(); ++i) {
    const v1::TransferBox& b = request.boxes(i);
    response->add_boxes();
    const std::string what =
        absl::StrCat("box ", i, " (participant ", b.participant_id(),
                     " buffer ", b.buffer(), ")");
    auto it = maps.find(b.participant_id());
    if (it == maps.end()) {
      std::shared_ptr<const MemoryMap> map = memory_of(b.participant_id());
      if (map == nullptr) {
        return absl::NotFoundError(
            absl::StrCat("participant ", b.participant_id(),
                         " is not registered through this daemon"));
      }
      it = maps.emplace(b.participant_id(), std::move(map)).first;
    }
    const MemoryMap& map = *it->second;
    if (b.buffer() >= map.size() || !map.mapped()) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": no such mapped buffer"));
    }
    if (b.strides_size() != b.extent_size() || b.unit_bytes() <= 0 ||
        b.byte_offset() < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": malformed (strides, extent, unit_bytes)"));
    }
    if (map.on_device(b.buffer())) {
      response->mutable_boxes(i)->set_unhashable("GPU memory");
      continue;
    }
    // The last byte the box touches must lie inside the buffer.
    int64_t last = 0, bytes = b.unit_bytes();
    bool ok = true, empty = false;
    Dims extent;
    for (int d = 0; d < b.extent_size(); ++d) {
      const int64_t e = b.extent(d), s = b.strides(d);
      if (e < 0 || s < 0) ok = false;
      if (e == 0) empty = true;
      int64_t step = 0;
      ok = ok && CheckedMul(std::max<int64_t>(e - 1, 0), s, &step) &&
           CheckedAdd(last, step, &last) && CheckedMul(bytes, e, &bytes);
      extent.push_back(e);
      strides[i].push_back(s);
    }
    int64_t end = 0;
    ok = ok && CheckedMul(last, b.unit_bytes(), &end) &&
         CheckedAdd(end, b.byte_offset(), &end) &&
         CheckedAdd(end, b.unit_bytes(), &end);
    if (!ok || (!empty && end > map.bytes(b.buffer()))) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, ": outside the buffer (", map.bytes(b.buffer()),
                       " bytes)"));
    }
    local.push_back(LocalBox{map.base(b.buffer()) + b.byte_offset(),
                             &strides[i], std::move(extent), b.unit_bytes(),
                             empty ? 0 : bytes});
    local_slot.push_back(i);
  }
  std::vector<uint64_t> hashes;
  std::vector<char> faulted;
  HashLocal(local, threads, &hashes, &faulted);
  for (size_t j = 0; j < hashes.size(); ++j) {
    v1::BoxChecksum* box = response->mutable_boxes(local_slot[j]);
    if (faulted[j]) {
      box->set_unhashable(kUnbackedReason);
    } else {
      box->set_hash(hashes[j]);
    }
  }
  return absl::OkStatus();
}

}  // namespace ferry
