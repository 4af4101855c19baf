#include "daemon/remote_transfers.h"

#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/piece.h"
#include "core/region_copy.h"
#include "proto/convert.h"
#include "daemon/status_util.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"

namespace ferry {
namespace {

std::string NewConnectionToken() {
  std::random_device rd;
  return absl::StrFormat("ferry-chan-%08x%08x%08x%08x", rd(), rd(), rd(),
                         rd());
}

bool SplitHostPort(const std::string& address, std::string* host,
                   int* port) {
  const size_t colon = address.rfind(':');
  if (colon == std::string::npos) return false;
  *host = address.substr(0, colon);
  if (host->size() >= 2 && (*host)[0] == '[') {
    *host = host->substr(1, host->size() - 2);
  }
  return absl::SimpleAtoi(address.substr(colon + 1), port);
}

absl::Status FromGrpc(const grpc::Status& s, absl::string_view what) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat(what, ": ", s.error_message()));
}

}  // namespace

RemoteTransfers::RemoteTransfers(Options options)
    : options_(std::move(options)) {}

RemoteTransfers::~RemoteTransfers() = default;

void RemoteTransfers::AddLocal(const std::string& participant_id,
                               std::shared_ptr<const MemoryMap> memory) {
  absl::MutexLock lock(&mu_);
  local_[participant_id] = std::move(memory);
}

void RemoteTransfers::RemoveLocal(const std::string& participant_id) {
  absl::MutexLock lock(&mu_);
  local_.erase(participant_id);
  staging_.erase(participant_id);
}

void RemoteTransfers::ForgetNode(const std::string& node) {
  std::unique_ptr<Channel> doomed;
  absl::MutexLock lock(&mu_);
  auto it = outgoing_.find(node);
  if (it == outgoing_.end()) return;
  doomed = std::move(it->second.channel);
  ++it->second.epoch;  // a transfer in flight does not put its channel back
}

bool RemoteTransfers::Handles(const TransferJob& job) const {
  const PlannedInstance& pi = job.plan->instances[job.instance];
  for (const auto& r : pi.ranks) {
    if (r != nullptr && r->node != options_.node) return true;
  }
  return false;
}

absl::StatusOr<std::unique_ptr<Channel>> RemoteTransfers::Connect(
    const std::string& node, const std::string& address, int64_t* epoch,
    absl::Time deadline) {
  auto stub = v1::Peer::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  v1::OpenChannelRequest req;
  req.set_caller_node(options_.node);
  req.set_channel_id(absl::StrCat(options_.node, "->", node));
  req.set_epoch(*epoch);
  req.mutable_tcp()->set_connection_count(1);
  v1::OpenChannelResponse resp;
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(std::min(deadline, absl::Now() + absl::Seconds(10))));
  absl::Status s = FromGrpc(stub->OpenChannel(&ctx, req, &resp),
                            absl::StrCat("OpenChannel to ", node));
  if (!s.ok()) return s;
  std::string host;
  int port = 0;
  if (!SplitHostPort(resp.tcp().address(), &host, &port)) {
    return absl::InternalError(absl::StrCat(
        "OpenChannel to ", node, ": bad address ", resp.tcp().address()));
  }
  TcpChannelOptions options;
  options.connection_token = resp.tcp().connection_token();
  return ConnectTcpChannel(host, port, deadline, options);
}

absl::Status RemoteTransfers::Execute(const TransferJob& job) {
  const StreamPlan& sp = *job.plan;
  const PlannedInstance& pi = sp.instances[job.instance];
  const std::vector<RankLayout>& layout = *pi.layout;
  TransferProgress& progress = *job.progress;
  const std::string node = pi.ranks[0]->node;
  for (const auto& r : pi.ranks) {
    if (r->node != node) {
      return absl::UnimplementedError(absl::StrCat(
          "instance ", pi.id, " has ranks on nodes ", node, " and ", r->node,
          "; an instance spread over several nodes is not supported yet"));
    }
  }
  const InstancePlan& ip = sp.direct_plan.instances[pi.plan_index];
  for (const Copy& c : ip.copies) {
    const Participant& src = *sp.sources[c.src_rank];
    if (src.node != options_.node || src.memory == nullptr ||
        !src.memory->mapped()) {
      return absl::UnimplementedError(absl::StrCat(
          src.Describe(), " is on node ", src.node,
          "; sources on a member node are not supported yet (they must be "
          "on the coordinator's node, ", options_.node, ")"));
    }
  }
  const std::string address =
      options_.address_of ? options_.address_of(node) : "";
  if (address.empty()) {
    return absl::UnavailableError(
        absl::StrCat("node ", node, " is not a live member"));
  }
  const absl::Time deadline = absl::Now() + options_.timeout;
  progress.bytes_total.store(ip.bytes);

  // The channel to the node: kept, or opened with the next epoch.
  std::unique_ptr<Channel> channel;
  int64_t epoch = 0;
  {
    absl::MutexLock lock(&mu_);
    Outgoing& out = outgoing_[node];
    channel = std::move(out.channel);
    if (channel == nullptr) ++out.epoch;
    epoch = out.epoch;
  }
  if (channel == nullptr) {
    absl::StatusOr<std::unique_ptr<Channel>> c =
        Connect(node, address, &epoch, deadline);
    if (!c.ok()) return c.status();
    channel = *std::move(c);
  }

  // The receiver's part and the sender's views, bucket by bucket.
  v1::RunTransferRequest req;
  req.set_caller_node(options_.node);
  req.set_stream(sp.stream);
  req.set_instance_id(pi.id);
  req.set_channel_id(absl::StrCat(options_.node, "->", node));
  req.set_channel_epoch(epoch);
  req.set_timeout_ms(absl::ToInt64Milliseconds(options_.timeout));
  // Staging for fallback tensors, reserved on the destination's node.
  if (pi.resolved != nullptr) {
    for (size_t r = 0; r < pi.ranks.size(); ++r) {
      const auto& fallback = pi.resolved->ranks[r].fallback;
      for (size_t k = 0; k < fallback.size(); ++k) {
        const ParamSpec& spec = sp.model.params[fallback[k].param];
        v1::StagingNeed* need = req.add_staging();
        need->set_participant_id(pi.ranks[r]->id);
        need->set_slot(static_cast<int32_t>(k));
        need->set_parameter(spec.name);
        need->set_bytes(BoxBytes(FullBox(spec.shape), spec.dtype));
      }
    }
  }
  std::vector<BucketView> views;
  views.reserve(ip.buckets.size());
  for (const Bucket& bucket : ip.buckets) {
    BucketView view;
    {
      absl::MutexLock lock(&mu_);
      view.id = next_bucket_++;
    }
    view.bytes = bucket.bytes;
    v1::TransferBucket* wire = req.add_receive();
    wire->set_id(view.id);
    wire->set_bytes(bucket.bytes);
    for (int32_t k = bucket.first_copy;
         k < bucket.first_copy + bucket.num_copies; ++k) {
      const Copy& c = ip.copies[k];
      const Piece& src = sp.source_layouts[c.src_rank].pieces[c.src_piece];
      const Piece& dst = layout[c.dst_rank].pieces[c.dst_piece];
      const DType dtype = sp.model.params[c.param].dtype;
      const Box box = ip.BoxOf(c, layout);
      const MemoryMap& src_memory = *sp.sources[c.src_rank]->memory;
      if (src.buffer >= src_memory.size()) {
        return absl::InternalError(absl::StrCat(
            sp.sources[c.src_rank]->Describe(), ": buffer ", src.buffer,
            " is not mapped"));
      }
      RegionView region;
      region.base =
          src_memory.base(src.buffer) + ByteOffsetOf(src, box, dtype);
      region.strides = src.strides;
      const Dims extent = StorageBox(box, dtype).extent;
      view.regions.push_back(region);
      view.extents.push_back(extent);
      view.unit_bytes.push_back(UnitBytes(dtype));

      v1::TransferBox* b = wire->add_boxes();
      b->set_participant_id(pi.ranks[c.dst_rank]->id);
      b->set_buffer(dst.buffer);
      b->set_byte_offset(ByteOffsetOf(dst, box, dtype));
      for (int64_t st : dst.strides) b->add_strides(st);
      for (int64_t e : extent) b->add_extent(e);
      b->set_unit_bytes(UnitBytes(dtype));
    }
    views.push_back(std::move(view));
  }

  // The receiver's RunTransfer runs while this thread sends.
  auto stub = v1::Peer::NewStub(
      grpc::CreateChannel(address, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(deadline));
  v1::RunTransferResponse resp;
  grpc::Status rpc_status;
  std::thread receiver(
      [&] { rpc_status = stub->RunTransfer(&ctx, req, &resp); });

  absl::Status sent = absl::OkStatus();
  for (const BucketView& view : views) {
    if (progress.cancel.load()) {
      sent = absl::CancelledError("cancelled");
      break;
    }
    sent = channel->Send(view, deadline);
    if (!sent.ok()) break;
    progress.bytes_moved.fetch_add(view.bytes);
  }
  if (sent.ok()) sent = channel->Flush(deadline);
  if (!sent.ok()) {
    channel.reset();  // the receiver sees the connection close
    ctx.TryCancel();
  }
  receiver.join();
  absl::Status received =
      FromGrpc(rpc_status, absl::StrCat("node ", node, " RunTransfer"));
  if (!sent.ok() || !received.ok()) {
    // Broken for good: the next transfer opens a higher epoch.
    return !sent.ok() ? sent : received;
  }
  if (job.apply != nullptr) {
    // APPLY names the staging on the ranks' node.
    job.apply->assign(pi.ranks.size(), v1::ApplyDetail());
    for (size_t r = 0; r < pi.ranks.size(); ++r) {
      v1::ApplyDetail& apply = (*job.apply)[r];
      const v1::ParticipantStaging* staging = nullptr;
      for (const v1::ParticipantStaging& ps : resp.staging()) {
        if (ps.participant_id() == pi.ranks[r]->id) staging = &ps;
      }
      if (staging == nullptr) continue;
      *apply.mutable_staging_regions() = staging->regions();
      if (pi.resolved == nullptr) continue;
      for (const FallbackTensor& f : pi.resolved->ranks[r].fallback) {
        const ParamSpec& spec = sp.model.params[f.param];
        for (const v1::StagingSlot& slot : staging->slots()) {
          if (slot.parameter() != spec.name) continue;
          v1::FallbackTensor* t = apply.add_fallback_tensors();
          t->set_parameter(spec.name);
          t->set_dtype(DTypeToProto(spec.dtype));
          for (int64_t d : spec.shape) t->add_shape(d);
          t->set_region_id(slot.region_id());
          t->set_byte_offset(0);
          t->set_size_bytes(slot.bytes());
        }
      }
    }
  }
  absl::MutexLock lock(&mu_);
  Outgoing& out = outgoing_[node];
  if (out.epoch == epoch) out.channel = std::move(channel);
  return absl::OkStatus();
}

absl::Status RemoteTransfers::OpenChannel(
    const v1::OpenChannelRequest& request, v1::OpenChannelResponse* response) {
  if (request.caller_node().empty() || request.channel_id().empty() ||
      request.epoch() <= 0) {
    return absl::InvalidArgumentError(
        "OpenChannel: caller_node, channel_id and epoch > 0 are required");
  }
  if (!request.has_tcp()) {
    return absl::UnavailableError(
        "OpenChannel: only TCP channels are supported by this ferryd");
  }
  TcpChannelOptions options;
  options.connection_token = NewConnectionToken();
  absl::StatusOr<std::unique_ptr<TcpListener>> listener =
      TcpListener::Listen("", 0, options);
  if (!listener.ok()) return listener.status();
  absl::MutexLock lock(&mu_);
  Incoming& in = incoming_[request.channel_id()];
  if (request.epoch() <= in.epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "OpenChannel: epoch ", request.epoch(), " of channel ",
        request.channel_id(), " is not greater than the live one, ",
        in.epoch));
  }
  in.epoch = request.epoch();
  in.token = options.connection_token;
  in.channel.reset();
  in.listener = *std::move(listener);
  response->mutable_tcp()->set_address(
      absl::StrCat(options_.host, ":", in.listener->port()));
  response->mutable_tcp()->set_connection_token(in.token);
  return absl::OkStatus();
}

absl::Status RemoteTransfers::RunTransfer(
    const v1::RunTransferRequest& request,
    const std::function<bool()>& cancelled,
    v1::RunTransferResponse* response) {
  const absl::Time deadline =
      absl::Now() + (request.timeout_ms() > 0
                         ? absl::Milliseconds(request.timeout_ms())
                         : options_.timeout);
  std::unique_ptr<Channel> channel;
  std::unique_ptr<TcpListener> listener;
  std::vector<BucketView> views;
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
    // Staging on this node for the ranks' fallback tensors.
    std::map<std::string, std::vector<std::pair<std::string, int64_t>>> needs;
    std::map<std::string, std::map<int32_t, std::string>> slot_names;
    for (const v1::StagingNeed& n : request.staging()) {
      needs[n.participant_id()].emplace_back(n.parameter(), n.bytes());
      slot_names[n.participant_id()][n.slot()] = n.parameter();
    }
    std::map<std::string, std::map<int32_t, uint8_t*>> staging_bases;
    for (auto& [id, list] : needs) {
      std::shared_ptr<StagingArea>& area = staging_[id];
      if (area == nullptr) area = std::make_shared<StagingArea>(id);
      absl::Status reserved = area->Reserve(list);
      if (!reserved.ok()) return reserved;
      v1::ParticipantStaging* out = response->add_staging();
      out->set_participant_id(id);
      for (v1::MemoryRegion& region : area->Exported()) {
        *out->add_regions() = std::move(region);
      }
      for (const auto& [k, name] : slot_names[id]) {
        const StagingArea::Slot* slot = area->Find(name);
        if (slot == nullptr) continue;
        staging_bases[id][k] = slot->memory.data();
        v1::StagingSlot* ss = out->add_slots();
        ss->set_parameter(name);
        ss->set_region_id(slot->region_id);
        ss->set_bytes(slot->bytes);
      }
    }
    for (const v1::TransferBucket& wire : request.receive()) {
      BucketView view;
      view.id = wire.id();
      view.bytes = wire.bytes();
      for (const v1::TransferBox& b : wire.boxes()) {
        auto m = local_.find(b.participant_id());
        if (m == local_.end() || m->second == nullptr) {
          return absl::NotFoundError(absl::StrCat(
              "RunTransfer: participant ", b.participant_id(),
              " did not register through node ", options_.node));
        }
        const MemoryMap& memory = *m->second;
        uint8_t* base = nullptr;
        if (b.buffer() & kStagingBufferBit) {
          const int32_t k =
              static_cast<int32_t>(b.buffer() & ~kStagingBufferBit);
          auto& bases = staging_bases[b.participant_id()];
          auto slot = bases.find(k);
          if (slot != bases.end()) base = slot->second;
        } else if (b.buffer() < memory.size()) {
          base = memory.base(b.buffer());
        }
        if (base == nullptr) {
          return absl::InvalidArgumentError(absl::StrCat(
              "RunTransfer: participant ", b.participant_id(),
              " has no buffer ", b.buffer()));
        }
        RegionView region;
        region.base = base + b.byte_offset();
        region.strides.assign(b.strides().begin(), b.strides().end());
        view.regions.push_back(region);
        view.extents.emplace_back(b.extent().begin(), b.extent().end());
        view.unit_bytes.push_back(b.unit_bytes());
      }
      views.push_back(std::move(view));
    }
  }
  absl::Status s = absl::OkStatus();
  if (channel == nullptr) {
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
    s = channel->Receive(view, deadline);
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
