#include "client/destination_client.h"

#include <unistd.h>

#include <algorithm>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "client/registration_checks.h"
#include "core/region_copy.h"
#include "core/registration.h"
#include "core/registration_rules.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {
namespace {

std::string DestinationName(const DestinationOptions& options) {
  return absl::StrCat("instance ", options.instance_id, " tp rank ",
                      options.tp_rank);
}

constexpr absl::Duration kDeregisterTimeout = absl::Seconds(5);
constexpr absl::Duration kMaxBackoff = absl::Seconds(5);
// WaitForVersion: the gRPC deadline is longer than the daemon-side timeout,
// so the daemon's detailed DEADLINE_EXCEEDED message arrives (version.proto).
constexpr absl::Duration kWaitSlack = absl::Seconds(5);

absl::Status CheckEngineTable(absl::string_view who, const EngineTable& table,
                              const absl::flat_hash_map<uint32_t, int64_t>& sizes) {
  absl::flat_hash_set<std::string> names;
  for (const EngineParam& p : table.params) {
    const std::string where = absl::StrCat(who, ": engine parameter ", p.name);
    if (p.name.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": an engine parameter has no name"));
    }
    if (!names.insert(p.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " appears twice"));
    }
    if (p.dtype == DType::kInvalid) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has no dtype"));
    }
    absl::Status s = ValidateShape(p.local_shape, UnitBytes(p.dtype));
    if (!s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " local shape ", DimsToString(p.local_shape), ": ",
          s.message()));
    }
    auto region = sizes.find(p.buffer);
    if (region == sizes.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " is in region ", p.buffer, ", which is not registered"));
    }
    const int64_t units = Volume(StorageShape(p.local_shape, p.dtype));
    const int64_t bytes = units * UnitBytes(p.dtype);
    if (p.byte_offset < 0 || p.byte_offset > region->second ||
        bytes > region->second - p.byte_offset) {
      return absl::InvalidArgumentError(absl::StrCat(
          where, " at byte ", p.byte_offset, " (", bytes,
          " bytes) is not inside region ", p.buffer, " (", region->second,
          " bytes)"));
    }
  }
  return absl::OkStatus();
}

// The registration as the daemon converts it (core/registration.h): what
// BuildDestinationRegistration sends, before the wire.
DestinationRegistration CoreRegistration(const DestinationOptions& options,
                                         const DestinationLayout& layout) {
  DestinationRegistration r;
  r.instance_id = options.instance_id;
  r.stream = options.stream;
  r.node = options.node;
  r.tp_rank = options.tp_rank;
  r.tp_size = options.tp_size;
  r.pid = options.pid;
  r.held_version = options.held_version;
  r.cuda_device =
      DeviceOfRegions(layout.regions).kind() == v1::DEVICE_KIND_CUDA;
  for (const v1::MemoryRegion& region : layout.regions) {
    r.regions.push_back(RegionDeclFromProto(region));
  }
  if (layout.engine_table.has_value()) {
    r.layout = DestinationRegistration::Layout::kEngineTable;
    r.engine_params = layout.engine_table->params;
  } else {
    // Explicit pieces name their parameter by index into `model`; the
    // daemon's list is of names.
    r.layout = DestinationRegistration::Layout::kExplicitPieces;
    r.pieces = layout.pieces;
    for (const ParamSpec& p : layout.model.params) {
      r.piece_params.push_back(p.name);
    }
  }
  return r;
}

// One RegisterDestination RPC; checks the lease it grants.
absl::StatusOr<v1::RegisterDestinationResponse> SendRegisterDestination(
    const Connection& connection, const v1::RegisterDestinationRequest& request,
    const std::string& who) {
  v1::RegisterDestinationResponse response;
  auto context = connection.NewContext();
  const grpc::Status s = connection.registry().RegisterDestination(
      context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("RegisterDestination(", who, ")"));
  }
  if (response.lease_duration_ms() <= 0) {
    return absl::InternalError(absl::StrCat(
        "RegisterDestination(", who, "): the daemon returned lease ",
        response.lease_duration_ms(), " ms"));
  }
  return response;
}

}  // namespace

DestinationLayout DestinationLayout::FromEngineTable(
    EngineTable table, std::vector<v1::MemoryRegion> regions) {
  DestinationLayout layout;
  layout.engine_table = std::move(table);
  layout.regions = std::move(regions);
  return layout;
}

DestinationLayout DestinationLayout::FromPieces(
    ModelSpec model, std::vector<Piece> pieces,
    std::vector<v1::MemoryRegion> regions) {
  DestinationLayout layout;
  layout.model = std::move(model);
  layout.pieces = std::move(pieces);
  layout.regions = std::move(regions);
  return layout;
}

absl::Status ValidateDestinationRegistration(const DestinationOptions& options,
                                             const DestinationLayout& layout) {
  if (absl::Status s = ValidateName("instance_id", options.instance_id);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = ValidateName("stream", options.stream); !s.ok()) {
    return s;
  }
  if (!options.node.empty()) {
    if (absl::Status s = ValidateName("node", options.node); !s.ok()) return s;
  }
  const std::string who = DestinationName(options);
  if (absl::Status s = CheckRankInGroup(who, "tp_rank", options.tp_rank,
                                        "tp_size", options.tp_size);
      !s.ok()) {
    return s;
  }
  if (options.held_version < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": held_version must be >= 0"));
  }
  absl::flat_hash_map<uint32_t, int64_t> sizes;
  absl::StatusOr<std::vector<RegionDecl>> regions =
      CheckClientRegions(who, layout.regions, &sizes);
  if (!regions.ok()) return regions.status();
  if (layout.engine_table.has_value()) {
    if (!layout.pieces.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who, ": give an engine table or explicit pieces, not both"));
    }
    if (layout.engine_table->params.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": the engine table has no parameters"));
    }
    if (absl::Status s = CheckEngineTable(who, *layout.engine_table, sizes);
        !s.ok()) {
      return s;
    }
  } else {
    if (layout.pieces.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(who, ": neither an engine table nor explicit pieces"));
    }
    if (absl::Status s = CheckModel(who, layout.model); !s.ok()) return s;
    if (absl::Status s =
            CheckPieces(who, layout.model, layout.pieces, *regions);
        !s.ok()) {
      return s;
    }
  }
  // Last, the daemon's own check of the registration, step (c) of its walk
  // (core/registration_rules.h), on the same struct it converts to.
  return CheckDestinationRegistration(CoreRegistration(options, layout));
}

absl::StatusOr<v1::DestinationRegistration> BuildDestinationRegistration(
    const DestinationOptions& options, const DestinationLayout& layout) {
  v1::DestinationRegistration r;
  r.set_instance_id(options.instance_id);
  r.set_stream(options.stream);
  r.set_tp_rank(options.tp_rank);
  r.set_tp_size(options.tp_size);
  r.set_node(options.node);
  *r.mutable_device() = DeviceOfRegions(layout.regions);
  r.set_pid(options.pid != 0 ? options.pid : getpid());
  r.set_held_version(options.held_version);
  for (const v1::MemoryRegion& region : layout.regions) {
    *r.add_regions() = region;
  }
  if (layout.engine_table.has_value()) {
    *r.mutable_engine_table() = EngineTableToProto(*layout.engine_table);
  } else {
    v1::ExplicitPieces* pieces = r.mutable_explicit_pieces();
    for (const Piece& piece : layout.pieces) {
      absl::StatusOr<v1::Piece> wire = PieceToProto(piece, layout.model);
      if (!wire.ok()) return wire.status();
      *pieces->add_pieces() = *std::move(wire);
    }
  }
  return r;
}

absl::StatusOr<std::unique_ptr<DestinationClient>> DestinationClient::Register(
    const Connection& connection, const DestinationOptions& options,
    const DestinationLayout& layout, DestinationCallbacks callbacks) {
  if (absl::Status s = ValidateDestinationRegistration(options, layout);
      !s.ok()) {
    return s;
  }
  v1::RegisterDestinationRequest request;
  absl::StatusOr<v1::DestinationRegistration> registration =
      BuildDestinationRegistration(options, layout);
  if (!registration.ok()) return registration.status();
  *request.mutable_destination() = *std::move(registration);
  request.set_replace_existing(options.replace_existing);

  absl::StatusOr<v1::RegisterDestinationResponse> response =
      SendRegisterDestination(connection, request, DestinationName(options));
  if (!response.ok()) return response.status();
  LOG(INFO) << DestinationName(options) << " registered as "
            << response->handle().participant_id() << " (lease "
            << response->lease_duration_ms() << " ms)";
  return std::unique_ptr<DestinationClient>(new DestinationClient(
      connection, options, std::move(request), *std::move(response),
      std::move(callbacks)));
}

DestinationClient::DestinationClient(Connection connection,
                                     DestinationOptions options,
                                     v1::RegisterDestinationRequest request,
                                     v1::RegisterDestinationResponse response,
                                     DestinationCallbacks callbacks)
    : connection_(std::move(connection)),
      options_(std::move(options)),
      who_(DestinationName(options_)),
      callbacks_(std::move(callbacks)) {
  {
    absl::MutexLock lock(&mu_);
    request_ = std::move(request);
    request_.set_replace_existing(false);
    stream_ = options_.stream;
    committed_version_ = options_.held_version;
    handle_ = response.handle();
    lease_ = std::make_unique<LeaseKeeper>(
        connection_, handle_, absl::Milliseconds(response.lease_duration_ms()),
        who_);
  }
  reader_ = std::thread([this] { ReadEvents(); });
}

v1::ParticipantHandle DestinationClient::handle() const {
  absl::MutexLock lock(&mu_);
  return handle_;
}

int DestinationClient::reregistrations() const {
  absl::MutexLock lock(&mu_);
  return reregistrations_;
}

bool DestinationClient::Reregister() {
  absl::Duration backoff = options_.resubscribe_backoff;
  v1::RegisterDestinationRequest request;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return false;
      // The live buffers hold what this rank last committed, or applied
      // later: a COMMIT lost with a dying daemon does not make them older.
      request_.mutable_destination()->set_held_version(
          std::max(committed_version_, applied_version_));
      request = request_;
    }
    absl::StatusOr<v1::RegisterDestinationResponse> response =
        SendRegisterDestination(connection_, request, who_);
    if (response.ok()) {
      std::unique_ptr<LeaseKeeper> old;
      {
        absl::MutexLock lock(&mu_);
        old = std::move(lease_);
        handle_ = response->handle();
        lease_ = std::make_unique<LeaseKeeper>(
            connection_, handle_,
            absl::Milliseconds(response->lease_duration_ms()), who_);
        ++reregistrations_;
      }
      // Event ids are the new daemon's; none is a resend of an old one.
      verdicts_.clear();
      LOG(WARNING) << who_ << ": registered again as "
                   << response->handle().participant_id();
      return true;  // `old` stops here, outside the lock
    }
    if (!absl::IsUnavailable(response.status()) &&
        !absl::IsDeadlineExceeded(response.status())) {
      LOG(ERROR) << response.status() << " (no more events for this rank)";
      absl::MutexLock lock(&mu_);
      stream_status_ = response.status();
      return false;
    }
    LOG(WARNING) << response.status() << "; registering again in "
                 << absl::FormatDuration(backoff);
    absl::MutexLock lock(&mu_);
    auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), backoff);
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

DestinationClient::~DestinationClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    if (stream_context_ != nullptr) stream_context_->TryCancel();
  }
  reader_.join();
  v1::DeregisterRequest request;
  {
    absl::MutexLock lock(&mu_);
    lease_.reset();  // no heartbeat races the deregistration
    *request.mutable_handle() = handle_;
  }
  v1::DeregisterResponse response;
  auto context = connection_.NewContext(kDeregisterTimeout);
  const grpc::Status s =
      connection_.registry().Deregister(context.get(), request, &response);
  if (s.ok()) {
    LOG(INFO) << who_ << " deregistered";
  } else {
    LOG(WARNING) << FromGrpcStatus(s, absl::StrCat("Deregister(", who_, ")"));
  }
  staging_.clear();  // unmaps after the daemon stopped using them
}

void DestinationClient::ReadEvents() {
  absl::Duration backoff = options_.resubscribe_backoff;
  while (true) {
    // No deadline: the stream lives as long as the registration; the
    // destructor ends it with TryCancel.
    grpc::ClientContext context;
    uint64_t swaps;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      stream_context_ = &context;
      swaps = swaps_;
    }
    v1::SubscribeRequest request;
    {
      absl::MutexLock lock(&mu_);
      *request.mutable_handle() = handle_;
    }
    std::unique_ptr<grpc::ClientReader<v1::UpdateEvent>> reader =
        connection_.versions().Subscribe(&context, request);
    v1::UpdateEvent event;
    bool got_event = false;
    while (reader->Read(&event)) {
      got_event = true;
      backoff = options_.resubscribe_backoff;
      HandleEvent(event);
    }
    const grpc::Status s = reader->Finish();
    bool stopping, swapped;
    {
      absl::MutexLock lock(&mu_);
      stream_context_ = nullptr;
      // The old registration's stream ends when a swap lands (NOT_FOUND),
      // or SwapModel cancels it: follow the new handle once it is known.
      auto settled = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return !swapping_ || stopping_;
      };
      mu_.Await(absl::Condition(&settled));
      stopping = stopping_;
      swapped = swaps_ != swaps;
    }
    if (stopping) return;
    if (swapped) {
      // Event ids are the new participant's; none is a resend. Its
      // buffers hold the new registration's held_version.
      verdicts_.clear();
      applied_version_ = 0;
      backoff = options_.resubscribe_backoff;
      continue;
    }
    absl::Status error = FromGrpcStatus(s, absl::StrCat("Subscribe(", who_, ")"));
    if (s.ok()) {
      error = absl::UnavailableError(
          absl::StrCat("Subscribe(", who_, "): the daemon ended the stream"));
    }
    const grpc::StatusCode code = s.error_code();
    // The daemon does not know the handle (restarted, or the lease ran
    // out): register again.
    if (options_.reregister && (code == grpc::StatusCode::NOT_FOUND ||
                                code == grpc::StatusCode::PERMISSION_DENIED)) {
      LOG(WARNING) << error << "; registering again";
      if (!Reregister()) return;
      backoff = options_.resubscribe_backoff;
      continue;
    }
    // These end the registration's stream for good: the registration is
    // gone (NOT_FOUND), not ours (PERMISSION_DENIED, FAILED_PRECONDITION),
    // or another Subscribe for this participant took over (CANCELLED).
    if (code == grpc::StatusCode::NOT_FOUND ||
        code == grpc::StatusCode::PERMISSION_DENIED ||
        code == grpc::StatusCode::FAILED_PRECONDITION ||
        code == grpc::StatusCode::CANCELLED) {
      LOG(ERROR) << error << " (no more events for this rank)";
      absl::MutexLock lock(&mu_);
      stream_status_ = std::move(error);
      return;
    }
    LOG(WARNING) << error << "; subscribing again in "
                 << absl::FormatDuration(backoff);
    absl::MutexLock lock(&mu_);
    auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
    mu_.AwaitWithTimeout(absl::Condition(&stop), backoff);
    if (stopping_) return;
    if (!got_event) backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

void DestinationClient::HandleEvent(const v1::UpdateEvent& event) {
  VLOG(1) << who_ << ": event " << event.event_id() << " "
          << v1::UpdateEventKind_Name(event.kind()) << " v" << event.version();
  // After a resubscription the daemon resends the event awaiting our ack
  // with the same id: ack it again with the same verdict, without running
  // the callback twice.
  auto seen = verdicts_.find(event.event_id());
  if (event.event_id() != 0 && seen != verdicts_.end()) {
    if (event.ack_timeout_ms() > 0) Ack(event, seen->second);
    return;
  }
  absl::Status result = event.adapter_name().empty() ? Dispatch(event)
                                                     : DispatchAdapter(event);
  verdicts_[event.event_id()] = result;
  constexpr size_t kVerdictsKept = 64;
  while (verdicts_.size() > kVerdictsKept) verdicts_.erase(verdicts_.begin());
  if (event.kind() == v1::UPDATE_EVENT_KIND_APPLY && result.ok() &&
      event.adapter_name().empty()) {
    applied_version_ = std::max(applied_version_, event.version());
  }
  if (event.ack_timeout_ms() > 0) Ack(event, result);
}

absl::Status DestinationClient::Dispatch(const v1::UpdateEvent& event) {
  const int64_t v = event.version();
  switch (event.kind()) {
    case v1::UPDATE_EVENT_KIND_PREPARE:
      return callbacks_.on_prepare ? callbacks_.on_prepare(v)
                                   : absl::OkStatus();
    case v1::UPDATE_EVENT_KIND_PAUSE:
      return callbacks_.on_pause ? callbacks_.on_pause(v) : absl::OkStatus();
    case v1::UPDATE_EVENT_KIND_APPLY: {
      absl::StatusOr<std::vector<FallbackTensorView>> tensors =
          MapApply(event.apply());
      if (!tensors.ok()) return tensors.status();
      return callbacks_.on_apply ? callbacks_.on_apply(v, *tensors)
                                 : absl::OkStatus();
    }
    case v1::UPDATE_EVENT_KIND_COMMIT: {
      {
        absl::MutexLock lock(&mu_);
        committed_version_ = std::max(committed_version_, v);
      }
      if (callbacks_.on_commit) callbacks_.on_commit(v);
      return absl::OkStatus();
    }
    case v1::UPDATE_EVENT_KIND_ABORT: {
      {
        absl::MutexLock lock(&mu_);
        aborted_version_ = std::max(aborted_version_, v);
        abort_reason_ = event.abort().reason();
      }
      LOG(WARNING) << who_ << ": version " << v
                   << " aborted: " << event.abort().reason()
                   << (event.abort().dirty() ? " (dirty)" : " (clean)");
      if (callbacks_.on_abort) {
        callbacks_.on_abort(v, event.abort().reason(), event.abort().dirty());
      }
      return absl::OkStatus();
    }
    case v1::UPDATE_EVENT_KIND_OFFLOAD: {
      if (!callbacks_.on_offload) {
        return absl::UnimplementedError(absl::StrCat(
            who_, ": OFFLOAD needs an on_offload callback, which this "
            "engine did not give"));
      }
      const std::vector<uint32_t> ids(event.offload().region_ids().begin(),
                                      event.offload().region_ids().end());
      return callbacks_.on_offload(ids, event.offload().host_copy_kept());
    }
    case v1::UPDATE_EVENT_KIND_ONLOAD:
      return Onload(event);
    default:
      return absl::UnimplementedError(absl::StrCat(
          who_, ": the C++ client does not handle event ",
          v1::UpdateEventKind_IsValid(event.kind())
              ? v1::UpdateEventKind_Name(event.kind())
              : absl::StrCat("kind ", static_cast<int>(event.kind()))));
  }
}

absl::Status DestinationClient::DispatchAdapter(const v1::UpdateEvent& event) {
  const std::string& name = event.adapter_name();
  const int64_t v = event.version();
  switch (event.kind()) {
    case v1::UPDATE_EVENT_KIND_PREPARE:
      return absl::OkStatus();
    case v1::UPDATE_EVENT_KIND_PAUSE:
      return callbacks_.on_adapter_pause ? callbacks_.on_adapter_pause(name, v)
                                         : absl::OkStatus();
    case v1::UPDATE_EVENT_KIND_APPLY: {
      if (!callbacks_.on_adapter_apply) {
        return absl::UnimplementedError(absl::StrCat(
            who_, ": adapter ", name, " arrived, but this engine gave no "
            "on_adapter_apply callback (it does not serve LoRA adapters)"));
      }
      absl::StatusOr<std::vector<FallbackTensorView>> shares =
          MapApply(event.apply(), name);
      if (!shares.ok()) return shares.status();
      return callbacks_.on_adapter_apply(
          name, v, event.apply().adapter_config_json(), *shares);
    }
    case v1::UPDATE_EVENT_KIND_COMMIT:
      if (callbacks_.on_adapter_commit) callbacks_.on_adapter_commit(name, v);
      return absl::OkStatus();
    case v1::UPDATE_EVENT_KIND_ABORT:
      LOG(WARNING) << who_ << ": adapter " << name << " version " << v
                   << " aborted: " << event.abort().reason();
      if (callbacks_.on_adapter_abort) {
        callbacks_.on_adapter_abort(name, v, event.abort().reason(),
                                    event.abort().dirty());
      }
      return absl::OkStatus();
    case v1::UPDATE_EVENT_KIND_UNLOAD_ADAPTER: {
      if (!callbacks_.on_adapter_unload) {
        return absl::UnimplementedError(absl::StrCat(
            who_, ": UNLOAD_ADAPTER needs an on_adapter_unload callback, "
            "which this engine did not give"));
      }
      absl::Status s = callbacks_.on_adapter_unload(name);
      if (s.ok()) staging_.erase(name);  // the daemon releases it now
      return s;
    }
    default:
      return absl::UnimplementedError(absl::StrCat(
          who_, ": adapter event ",
          v1::UpdateEventKind_IsValid(event.kind())
              ? v1::UpdateEventKind_Name(event.kind())
              : absl::StrCat("kind ", static_cast<int>(event.kind())),
          " is not one an adapter receives"));
  }
}

absl::Status DestinationClient::Onload(const v1::UpdateEvent& event) {
  if (!callbacks_.on_onload) {
    return absl::UnimplementedError(absl::StrCat(
        who_, ": ONLOAD needs an on_onload callback, which this engine did "
        "not give"));
  }
  const std::vector<uint32_t> ids(event.onload().region_ids().begin(),
                                  event.onload().region_ids().end());
  absl::StatusOr<std::vector<v1::MemoryRegion>> regions =
      callbacks_.on_onload(ids);
  if (!regions.ok()) return regions.status();
  v1::UpdateRegionsRequest request;
  {
    absl::MutexLock lock(&mu_);
    *request.mutable_handle() = handle_;
  }
  for (const v1::MemoryRegion& r : *regions) *request.add_regions() = r;
  v1::UpdateRegionsResponse response;
  std::unique_ptr<grpc::ClientContext> context = connection_.NewContext();
  const grpc::Status s =
      connection_.registry().UpdateRegions(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("UpdateRegions(", who_, ")"));
  }
  // A later re-registration names the new memory.
  absl::MutexLock lock(&mu_);
  for (const v1::MemoryRegion& r : *regions) {
    for (v1::MemoryRegion& old :
         *request_.mutable_destination()->mutable_regions()) {
      if (old.region_id() == r.region_id()) old = r;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<FallbackTensorView>> DestinationClient::MapApply(
    const v1::ApplyDetail& apply, const std::string& adapter) {
  std::map<uint32_t, MappedStaging>& staging = staging_[adapter];
  // Map new staging regions; unmap those the daemon released (a region
  // missing from this APPLY, docs/api.md "Staging").
  std::map<uint32_t, MappedStaging> kept;
  for (const v1::MemoryRegion& r : apply.staging_regions()) {
    if (!r.has_shared_memory()) {
      return absl::UnimplementedError(absl::StrCat(
          who_, ": staging region ", r.region_id(),
          " is not host shared memory (CUDA staging needs a CUDA client)"));
    }
    const v1::SharedMemoryRegion& shm = r.shared_memory();
    const std::string path =
        shm.has_memfd() ? absl::StrCat("/proc/", shm.memfd().pid(), "/fd/",
                                       shm.memfd().fd())
                        : shm.shm_name();
    // Region ids are per registration: after the daemon restarted (or this
    // rank registered again) the same id names another file, so a mapping
    // is kept only for the very same file.
    auto it = staging.find(r.region_id());
    if (it != staging.end() && it->second.size == r.size_bytes() &&
        it->second.offset == shm.file_offset_bytes() &&
        it->second.region.name() == path) {
      kept.emplace(r.region_id(), std::move(it->second));
      staging.erase(it);
      continue;
    }
    const int64_t map_bytes = shm.file_offset_bytes() + r.size_bytes();
    absl::StatusOr<SharedMemoryRegion> mapped =
        shm.has_memfd() ? SharedMemoryRegion::OpenByPath(path, map_bytes)
                        : SharedMemoryRegion::Open(path, map_bytes);
    if (!mapped.ok()) {
      return absl::Status(mapped.status().code(),
                          absl::StrCat(who_, ": mapping staging region ",
                                       r.region_id(), ": ",
                                       mapped.status().message()));
    }
    kept.emplace(r.region_id(),
                 MappedStaging{*std::move(mapped), shm.file_offset_bytes(),
                               r.size_bytes()});
  }
  staging = std::move(kept);  // what was left in staging_ is unmapped here

  std::vector<FallbackTensorView> views;
  views.reserve(apply.fallback_tensors_size());
  for (const v1::FallbackTensor& t : apply.fallback_tensors()) {
    auto it = staging.find(t.region_id());
    if (it == staging.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who_, ": fallback tensor ", t.parameter(), " is in region ",
          t.region_id(), ", which the APPLY event does not list"));
    }
    const MappedStaging& m = it->second;
    if (t.byte_offset() < 0 || t.size_bytes() < 0 || t.byte_offset() > m.size ||
        t.size_bytes() > m.size - t.byte_offset()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who_, ": fallback tensor ", t.parameter(), " bytes [",
          t.byte_offset(), ", +", t.size_bytes(), ") are outside staging region ",
          t.region_id(), " (", m.size, " bytes)"));
    }
    absl::StatusOr<DType> dtype = DTypeFromProto(t.dtype());
    if (!dtype.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          who_, ": fallback tensor ", t.parameter(), ": ",
          dtype.status().message()));
    }
    FallbackTensorView view;
    view.parameter = t.parameter();
    view.dtype = *dtype;
    view.shape = Dims(t.shape().begin(), t.shape().end());
    if (t.has_share()) {
      Box share{Dims(t.share().offset().begin(), t.share().offset().end()),
                Dims(t.share().extent().begin(), t.share().extent().end())};
      absl::Status inside = ValidateBoxInShape(share, view.shape);
      if (!inside.ok() || BoxBytes(share, *dtype) != t.size_bytes()) {
        return absl::InvalidArgumentError(absl::StrCat(
            who_, ": tensor ", t.parameter(), " share ", BoxToString(share),
            " does not fit its shape ", DimsToString(view.shape), " and ",
            t.size_bytes(), " bytes"));
      }
      view.share = std::move(share);
    }
    view.bytes = absl::Span<const uint8_t>(
        m.region.data() + m.offset + t.byte_offset(),
        static_cast<size_t>(t.size_bytes()));
    views.push_back(std::move(view));
  }
  return views;
}

void DestinationClient::Ack(const v1::UpdateEvent& event,
                            const absl::Status& result) {
  v1::AckRequest request;
  *request.mutable_handle() = handle();
  request.set_event_id(event.event_id());
  request.set_version(event.version());
  request.set_kind(event.kind());
  if (result.ok()) {
    request.set_status(v1::ACK_STATUS_OK);
  } else {
    request.set_status(v1::ACK_STATUS_FAILED);
    request.set_error_message(std::string(result.message()));
    LOG(ERROR) << who_ << ": " << v1::UpdateEventKind_Name(event.kind())
               << " v" << event.version() << " failed: " << result;
  }
  v1::AckResponse response;
  auto context = connection_.NewContext();
  const grpc::Status s =
      connection_.versions().Ack(context.get(), request, &response);
  if (!s.ok()) {
    // ABORTED means the version failed meanwhile; an ABORT event follows.
    LOG(WARNING) << FromGrpcStatus(
        s, absl::StrCat("Ack(", v1::UpdateEventKind_Name(event.kind()), " v",
                        event.version(), ") of ", who_));
  }
}

absl::Status DestinationClient::SwapModel(const DestinationOptions& options,
                                          const DestinationLayout& layout,
                                          absl::Duration timeout) {
  if (options.instance_id != options_.instance_id ||
      options.tp_rank != options_.tp_rank ||
      options.tp_size != options_.tp_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "SwapModel(", who_, "): the new options must keep instance_id ",
        options_.instance_id, ", tp_rank ", options_.tp_rank,
        " and tp_size ", options_.tp_size));
  }
  absl::StatusOr<v1::DestinationRegistration> registration =
      BuildDestinationRegistration(options, layout);  // validates first
  if (!registration.ok()) return registration.status();
  v1::SwapModelRequest request;
  {
    absl::MutexLock lock(&mu_);
    if (swapping_) {
      return absl::FailedPreconditionError(
          absl::StrCat("SwapModel(", who_, "): a swap is in progress"));
    }
    swapping_ = true;
    *request.mutable_handle() = handle_;
  }
  *request.mutable_new_registration() = *registration;
  v1::SwapModelResponse response;
  auto context = connection_.NewContext(timeout);
  const grpc::Status s =
      connection_.lifecycle().SwapModel(context.get(), request, &response);
  std::unique_ptr<LeaseKeeper> old;
  absl::MutexLock lock(&mu_);
  swapping_ = false;
  if (!s.ok()) return FromGrpcStatus(s, absl::StrCat("SwapModel(", who_, ")"));
  old = std::move(lease_);
  handle_ = response.handle();
  lease_ = std::make_unique<LeaseKeeper>(
      connection_, handle_, absl::Milliseconds(response.lease_duration_ms()),
      who_);
  *request_.mutable_destination() = *registration;
  stream_ = options.stream;
  committed_version_ = options.held_version;
  aborted_version_ = 0;
  abort_reason_.clear();
  ++swaps_;
  if (stream_context_ != nullptr) stream_context_->TryCancel();
  LOG(INFO) << who_ << ": swapped to stream " << options.stream << " as "
            << handle_.participant_id();
  return absl::OkStatus();  // `old` stops here, outside the lock
}

absl::StatusOr<v1::InstanceStatus> DestinationClient::WaitForVersion(
    int64_t version, absl::Duration timeout) {
  v1::WaitForVersionRequest request;
  {
    absl::MutexLock lock(&mu_);
    request.set_stream(stream_);
  }
  request.set_version(version);
  request.set_instance_id(options_.instance_id);
  request.set_timeout_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout)));
  v1::WaitForVersionResponse response;
  auto context = connection_.NewContext(timeout + kWaitSlack);
  const grpc::Status s =
      connection_.versions().WaitForVersion(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("WaitForVersion(", version, ") of ",
                                          who_));
  }
  for (const v1::InstanceStatus& st : response.instances()) {
    if (st.instance_id() == options_.instance_id) return st;
  }
  return absl::InternalError(absl::StrCat(
      "WaitForVersion(", version, "): the daemon did not report ",
      options_.instance_id));
}

absl::Status DestinationClient::AwaitCommitted(int64_t version,
                                               absl::Duration timeout) {
  absl::MutexLock lock(&mu_);
  auto settled = [this, version]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
    return committed_version_ >= version || aborted_version_ >= version ||
           !stream_status_.ok();
  };
  mu_.AwaitWithTimeout(absl::Condition(&settled), timeout);
  if (committed_version_ >= version) return absl::OkStatus();
  if (aborted_version_ >= version) {
    return absl::AbortedError(absl::StrCat(who_, ": version ", aborted_version_,
                                           " aborted: ", abort_reason_));
  }
  if (!stream_status_.ok()) return stream_status_;
  return absl::DeadlineExceededError(absl::StrCat(
      who_, ": no COMMIT for version ", version, " within ",
      absl::FormatDuration(timeout), " (holds version ", committed_version_,
      ")"));
}

int64_t DestinationClient::committed_version() const {
  absl::MutexLock lock(&mu_);
  return committed_version_;
}

absl::Status DestinationClient::status() const {
  absl::MutexLock lock(&mu_);
  if (!stream_status_.ok()) return stream_status_;
  absl::Status lease = lease_->status();
  // A lost lease ends the Subscribe stream too; the reader registers again
  // or records why it cannot (stream_status_).
  if (options_.reregister && !lease.ok()) return absl::OkStatus();
  return lease;
}

}  // namespace ferry
