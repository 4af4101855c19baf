// RemoteTransfers, the receiving side (remote_transfers.h): the channels
// peers open into this daemon (OpenChannel: a TCP or UCX listener per
// channel and epoch, or an NCCL communicator joined on a thread of its own) and the
// parts of a transfer a peer asks of this node (RunTransfer: receive into
// the memory and staging of ranks registered here, send from sources
// registered here, or copy between them on this node).
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/checked_math.h"
#include "daemon/memory/memory_map.h"
#include "daemon/transfer/remote_transfers.h"
#include "glog/logging.h"
#include "transport/tcp/tcp_channel.h"
#include "transport/ucx/ucx_channel.h"

namespace ferry {
namespace {

// Channels one peer may hold into this daemon (one per route and
// transport; a cluster has a handful), and the length of their names.
constexpr int kMaxChannelsPerPeer = 16;
constexpr size_t kMaxChannelIdBytes = 512;
// A UCX_TLS list names a few transports; it only goes into messages here.
constexpr size_t kMaxUcxTransportsBytes = 256;

std::string NewConnectionToken() {
  std::random_device rd;
  return absl::StrFormat("ferry-chan-%08x%08x%08x%08x", rd(), rd(), rd(),
                         rd());
}

}  // namespace

absl::Status RemoteTransfers::OpenChannel(
    const v1::OpenChannelRequest& request, v1::OpenChannelResponse* response) {
  if (request.caller_node().empty() || request.channel_id().empty() ||
      request.epoch() <= 0) {
    return absl::InvalidArgumentError(
        "OpenChannel: caller_node, channel_id and epoch > 0 are required");
  }
  if (request.has_nccl()) return OpenFabric(request);
  const std::string token = NewConnectionToken();
  absl::StatusOr<std::unique_ptr<ChannelListener>> listener;
  std::string ucx_worker_address;
  if (request.has_ucx()) {
    if (request.ucx().transports().size() > kMaxUcxTransportsBytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "OpenChannel ucx: transports of ", request.ucx().transports().size(),
          " bytes (at most ", kMaxUcxTransportsBytes, ")"));
    }
    UcxChannelOptions options;
    options.transports = options_.ucx_transports;
    options.connection_token = token;
    absl::StatusOr<std::unique_ptr<UcxListener>> ucx =
        ListenUcx(options_.listen_host, 0, options);
    if (!ucx.ok()) {
      return absl::Status(
          ucx.status().code(),
          absl::StrCat("OpenChannel ucx on node ", options_.node,
                       " (its transports \"", options_.ucx_transports,
                       "\", the caller's \"", request.ucx().transports(),
                       "\"): ", ucx.status().message()));
    }
    ucx_worker_address = (*ucx)->worker_address();
    listener = *std::move(ucx);
  } else if (request.has_tcp()) {
    TcpChannelOptions options;
    options.connection_token = token;
    listener = ListenTcp(options_.listen_host, 0, options);
    if (!listener.ok()) return listener.status();
  } else {
    return absl::InvalidArgumentError(
        "OpenChannel: a transport (tcp, ucx or nccl) is required");
  }
  absl::MutexLock lock(&mu_);
  absl::StatusOr<Incoming*> fresh = NewEpochLocked(request);
  if (!fresh.ok()) return fresh.status();
  Incoming& in = **fresh;
  in.token = token;
  LOG(INFO) << "node " << request.caller_node() << " opens a "
            << (request.has_ucx() ? "ucx" : "tcp") << " channel into this "
            << "node (" << request.channel_id() << ", epoch "
            << request.epoch() << ")";
  in.listener = *std::move(listener);
  response->mutable_tcp()->set_address(
      absl::StrCat(options_.host, ":", in.listener->port()));
  response->mutable_tcp()->set_connection_token(in.token);
  response->set_ucx_worker_address(ucx_worker_address);
  return absl::OkStatus();
}

absl::StatusOr<RemoteTransfers::Incoming*> RemoteTransfers::NewEpochLocked(
    const v1::OpenChannelRequest& request) {
  // A peer's channels are named "<its node>-><route>", and it may hold a
  // few (one per route to this node and transport): every entry keeps a
  // listener's fd, so a caller cannot pile up more.
  const std::string prefix = absl::StrCat(request.caller_node(), "->");
  if (!absl::StartsWith(request.channel_id(), prefix) ||
      request.channel_id().size() > kMaxChannelIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "OpenChannel: channel_id must be \"<caller_node>-><route>\" of at "
        "most ", kMaxChannelIdBytes, " bytes"));
  }
  if (incoming_.count(request.channel_id()) == 0) {
    int held = 0;
    for (auto it = incoming_.lower_bound(prefix);
         it != incoming_.end() && absl::StartsWith(it->first, prefix); ++it) {
      ++held;
    }
    if (held >= kMaxChannelsPerPeer) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "OpenChannel: node ", request.caller_node(), " already holds ",
          held, " channels into node ", options_.node, " (at most ",
          kMaxChannelsPerPeer, ")"));
    }
  }
  Incoming& in = incoming_[request.channel_id()];
  if (request.epoch() <= in.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenChannel: epoch ", request.epoch(), " of channel ",
        request.channel_id(), " is not greater than the live one, ",
        in.epoch));
  }
  // The lower epoch's channel goes (an NCCL communicator is aborted).
  in = Incoming();
  in.epoch = request.epoch();
  return &in;
}

absl::Status RemoteTransfers::OpenFabric(const v1::OpenChannelRequest& request) {
  const v1::NcclChannelSetup& setup = request.nccl();
  if (setup.unique_id().empty() || setup.world_size() != 2 ||
      setup.ranks_size() != 1 || setup.ranks(0).rank() != 1) {
    return absl::InvalidArgumentError(
        "OpenChannel nccl: a unique_id, world_size 2 and this daemon as "
        "rank 1 are required (the channels are two-rank communicators)");
  }
  const std::string& uuid = setup.ranks(0).cuda_uuid();
  const int gpu =
      options_.devices == nullptr ? -1 : options_.devices->GpuOf(uuid);
  if (gpu < 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenChannel nccl: node ", options_.node, " has no GPU ",
        uuid.empty() ? "at all" : uuid,
        options_.devices == nullptr
            ? std::string()
            : absl::StrCat(" (", options_.devices->Available().message(), ")")));
  }
  auto join = std::make_shared<FabricJoin>();
  absl::MutexLock lock(&mu_);
  // Reap the joins that ended.
  for (auto it = joins_.begin(); it != joins_.end();) {
    if ((*it)->done.HasBeenNotified()) {
      (*it)->thread.join();
      it = joins_.erase(it);
    } else {
      ++it;
    }
  }
  absl::StatusOr<Incoming*> fresh = NewEpochLocked(request);
  if (!fresh.ok()) return fresh.status();
  (*fresh)->fabric = join;
  // Joining blocks until the sender has joined too, which it does once
  // this call returns: so on a thread of its own.
  DeviceMemory* devices = options_.devices;
  const std::string id = setup.unique_id();
  const int64_t epoch = request.epoch();
  FabricJoin* j = join.get();
  join->thread = std::thread([j, devices, gpu, id, epoch] {
    j->channel = devices->JoinFabric(gpu, id, /*rank=*/1, epoch,
                                     absl::Now() + kFabricJoinTimeout);
    j->done.Notify();
  });
  joins_.push_back(std::move(join));
  return absl::OkStatus();
}

absl::Status RemoteTransfers::RunTransfer(
    const v1::RunTransferRequest& request,
    const std::function<bool()>& cancelled,
    v1::RunTransferResponse* response) {
  if (request.role() == "send") return RunSend(request, cancelled, response);
  if (request.role() == "local") return RunLocal(request, cancelled, response);
  if (!request.role().empty() && request.role() != "receive") {
    return absl::InvalidArgumentError(
        absl::StrCat("RunTransfer: unknown role \"", request.role(), "\""));
  }
  return RunReceive(request, cancelled, response);
}

absl::Status RemoteTransfers::ReserveStagingLocked(
    const v1::RunTransferRequest& request, v1::RunTransferResponse* response,
    StagingBases* staging_bases, KeepAlive* keep) {
  // Staging on this node for the ranks' fallback tensors.
  std::map<std::string, std::vector<std::pair<std::string, int64_t>>> needs;
  std::map<std::string, std::map<int32_t, std::string>> slot_names;
  int64_t wanted = 0;
  for (const v1::StagingNeed& n : request.staging()) {
    needs[n.participant_id()].emplace_back(n.parameter(), n.bytes());
    slot_names[n.participant_id()][n.slot()] = n.parameter();
    if (n.bytes() < 0 || !CheckedAdd(wanted, n.bytes(), &wanted)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "RunTransfer: staging need of ", n.parameter(), " is ", n.bytes(),
          " bytes"));
    }
  }
  // This node's limit is on all its staging together: what other ranks
  // hold plus what these need (their own slots are replaced, not added).
  if (options_.max_staging_bytes >= 0 && !needs.empty()) {
    int64_t others = 0;
    for (const auto& [id, area] : staging_) {
      if (area != nullptr && needs.count(id) == 0) {
        others += area->reserved_bytes();
      }
    }
    if (wanted > options_.max_staging_bytes - others) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "node ", options_.node, ": its ranks need ", wanted,
          " bytes of staging for their fallback tensors; with the ", others,
          " bytes other ranks there hold, that is over its staging limit of ",
          options_.max_staging_bytes, " bytes (--max_staging_mb)"));
    }
  }
  for (auto& [id, list] : needs) {
    std::shared_ptr<StagingArea>& area = staging_[id];
    if (area == nullptr) {
      // A rank that registered GPU memory gets staging its GPU can write.
      auto m = local_.find(id);
      const bool gpu_rank = m != local_.end() && m->second != nullptr &&
                            m->second->any_on_device();
      area = std::make_shared<StagingArea>(
          id, gpu_rank ? options_.devices : nullptr);
    }
    absl::Status reserved = area->Reserve(list);
    if (!reserved.ok()) return reserved;
    keep->push_back(area);
    v1::ParticipantStaging* out = response->add_staging();
    out->set_participant_id(id);
    for (v1::MemoryRegion& region : area->Exported()) {
      *out->add_regions() = std::move(region);
    }
    for (const auto& [k, name] : slot_names[id]) {
      const StagingArea::Slot* slot = area->Find(name);
      if (slot == nullptr) continue;
      BufferPlace place;
      place.base = slot->data();
      place.pinned = area->pinned();
      place.gpu = area->gpu();
      (*staging_bases)[id][k] = place;
      v1::StagingSlot* ss = out->add_slots();
      ss->set_parameter(name);
      ss->set_region_id(slot->region_id);
      ss->set_bytes(slot->bytes);
    }
  }
  return absl::OkStatus();
}

absl::Status RemoteTransfers::ViewsLocked(
    const google::protobuf::RepeatedPtrField<v1::TransferBucket>& buckets,
    const StagingBases& staging_bases, bool gpu_ok,
    std::vector<BucketView>* views, Places* places, KeepAlive* keep) {
  for (const v1::TransferBucket& wire : buckets) {
    BucketView view;
    view.id = wire.id();
    view.bytes = wire.bytes();
    places->emplace_back();
    for (const v1::TransferBox& b : wire.boxes()) {
      BufferPlace place;
      auto rm = receiving_.find(b.participant_id());
      auto m = local_.find(b.participant_id());
      if (rm != receiving_.end()) {
        // A rank on the coordinator's node: the memory and staging it mapped.
        place = rm->second.Find(b.buffer());
        keep->push_back(rm->second.client);
        keep->push_back(rm->second.staging);
      } else if (m == local_.end() || m->second == nullptr) {
        return absl::NotFoundError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(),
            " did not register through node ", options_.node));
      } else if (m->second->released()) {
        // Offloaded (member_memory.h): the protocol sends it nothing.
        return absl::FailedPreconditionError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(), " on node ",
            options_.node, " released its memory (Lifecycle.Offload)"));
      } else if (b.buffer() & kStagingBufferBit) {
        const int32_t k =
            static_cast<int32_t>(b.buffer() & ~kStagingBufferBit);
        auto bases = staging_bases.find(b.participant_id());
        if (bases != staging_bases.end()) {
          auto slot = bases->second.find(k);
          if (slot != bases->second.end()) place = slot->second;
        }
      } else {
        place = PlaceIn(*m->second, b.buffer());
        keep->push_back(m->second);
      }
      if (place.base == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(),
            " has no buffer ", b.buffer()));
      }
      if (place.on_gpu() && !gpu_ok) {
        return absl::UnimplementedError(absl::StrCat(
            "RunTransfer: participant ", b.participant_id(), " buffer ",
            b.buffer(), " is GPU memory, which between nodes needs the NCCL "
            "channel, not wired into ferryd yet"));
      }
      places->back().push_back(place);
      RegionView region;
      region.base = place.base + b.byte_offset();
      region.strides.assign(b.strides().begin(), b.strides().end());
      view.regions.push_back(region);
      view.extents.emplace_back(b.extent().begin(), b.extent().end());
      view.unit_bytes.push_back(b.unit_bytes());
    }
    views->push_back(std::move(view));
  }
  return absl::OkStatus();
}

absl::Status RemoteTransfers::RunSend(const v1::RunTransferRequest& request,
                                      const std::function<bool()>& cancelled,
                                      v1::RunTransferResponse* response) {
  if (request.peer_node().empty() || request.peer_address().empty() ||
      request.send_size() != request.receive_size()) {
    return absl::InvalidArgumentError(
        "RunTransfer send: peer_node, peer_address and one send bucket per "
        "receive bucket are required");
  }
  const absl::Time deadline =
      absl::Now() + (request.timeout_ms() > 0
                         ? absl::Milliseconds(request.timeout_ms())
                         : options_.timeout);
  std::vector<BucketView> views;
  Places places;
  KeepAlive keep;
  {
    absl::MutexLock lock(&mu_);
    absl::Status s = ViewsLocked(request.send(), StagingBases(),
                                 /*gpu_ok=*/request.has_nccl(), &views,
                                 &places, &keep);
    if (!s.ok()) return s;
  }
  if (request.has_nccl()) {
    if (absl::Status s = PinForFabric(places); !s.ok()) return s;
  }
  return SendRoute(request.peer_node(), request.peer_address(), request,
                   views, deadline, cancelled, [](int64_t) {}, response);
}

absl::Status RemoteTransfers::RunLocal(const v1::RunTransferRequest& request,
                                       const std::function<bool()>& cancelled,
                                       v1::RunTransferResponse* response) {
  if (request.send_size() != request.receive_size()) {
    return absl::InvalidArgumentError(
        "RunTransfer local: one send bucket per receive bucket is required");
  }
  std::vector<BucketView> from, to;
  Places from_places, to_places;
  KeepAlive keep;
  {
    absl::MutexLock lock(&mu_);
    StagingBases staging_bases;
    absl::Status s =
        ReserveStagingLocked(request, response, &staging_bases, &keep);
    if (s.ok()) {
      s = ViewsLocked(request.send(), StagingBases(), /*gpu_ok=*/true, &from,
                      &from_places, &keep);
    }
    if (s.ok()) {
      s = ViewsLocked(request.receive(), staging_bases, /*gpu_ok=*/true, &to,
                      &to_places, &keep);
    }
    if (!s.ok()) return s;
  }
  absl::StatusOr<int64_t> copied =
      CopyHere(from, from_places, to, to_places, cancelled, [](int64_t) {});
  if (!copied.ok()) {
    if (absl::IsCancelled(copied.status())) {
      return absl::CancelledError("RunTransfer cancelled by the caller");
    }
    return absl::Status(copied.status().code(),
                        absl::StrCat("RunTransfer local on node ",
                                     options_.node, ": ",
                                     copied.status().message()));
  }
  response->set_bytes_received(*copied);
  return absl::OkStatus();
}

absl::Status RemoteTransfers::RunReceive(
    const v1::RunTransferRequest& request,
    const std::function<bool()>& cancelled,
    v1::RunTransferResponse* response) {
  const absl::Time deadline =
      absl::Now() + (request.timeout_ms() > 0
                         ? absl::Milliseconds(request.timeout_ms())
                         : options_.timeout);
  std::unique_ptr<Channel> channel;
  std::unique_ptr<ChannelListener> listener;
  std::shared_ptr<FabricJoin> fabric;
  std::vector<BucketView> views;
  Places places;
  KeepAlive keep;
  {
    absl::MutexLock lock(&mu_);
    auto it = incoming_.find(request.channel_id());
    if (it == incoming_.end() || it->second.epoch != request.channel_epoch()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "RunTransfer: no channel ", request.channel_id(), " at epoch ",
          request.channel_epoch(), " (open it with OpenChannel)"));
    }
    channel = std::move(it->second.channel);
    listener = std::move(it->second.listener);
    fabric = std::move(it->second.fabric);
    StagingBases staging_bases;
    absl::Status s =
        ReserveStagingLocked(request, response, &staging_bases, &keep);
    if (s.ok()) {
      s = ViewsLocked(request.receive(), staging_bases,
                      /*gpu_ok=*/request.has_nccl(), &views, &places, &keep);
    }
    if (!s.ok()) return s;
  }
  absl::Status s = absl::OkStatus();
  if (request.has_nccl()) s = PinForFabric(places);
  if (s.ok() && channel == nullptr && fabric != nullptr) {
    // The NCCL channel OpenChannel began joining.
    if (!fabric->done.WaitForNotificationWithDeadline(deadline)) {
      s = absl::DeadlineExceededError(absl::StrCat(
          "RunTransfer: the NCCL channel ", request.channel_id(),
          " was not joined by the deadline"));
    } else if (!fabric->channel.ok()) {
      s = fabric->channel.status();
    } else {
      channel = *std::move(fabric->channel);
    }
  }
  if (s.ok() && channel == nullptr) {
    if (listener == nullptr) {
      return absl::FailedPreconditionError("RunTransfer: channel is busy");
    }
    while (true) {
      absl::StatusOr<std::unique_ptr<Channel>> c = listener->Accept(deadline);
      if (c.ok()) {
        channel = *std::move(c);
        break;
      }
      if (c.status().code() != absl::StatusCode::kPermissionDenied) {
        s = c.status();
        break;
      }
      LOG(WARNING) << c.status();
    }
  }
  int64_t received = 0;
  for (const BucketView& view : views) {
    if (!s.ok()) break;
    if (cancelled()) {
      s = absl::CancelledError("RunTransfer cancelled by the sender");
      break;
    }
    s = NameMemoryFault(channel->Receive(view, deadline));
    if (s.ok()) received += view.bytes;
  }
  response->set_bytes_received(received);
  absl::MutexLock lock(&mu_);
  auto it = incoming_.find(request.channel_id());
  if (s.ok() && it != incoming_.end() &&
      it->second.epoch == request.channel_epoch()) {
    it->second.channel = std::move(channel);  // kept for the next version
  } else if (!s.ok()) {
    LOG(WARNING) << "channel " << request.channel_id() << " epoch "
                 << request.channel_epoch() << " failed: " << s;
  }
  return s;
}

}  // namespace ferry
