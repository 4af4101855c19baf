#include "client/source_client.h"

#include <unistd.h>

#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/registration_checks.h"
#include "core/registration.h"
#include "core/registration_rules.h"
#include "glog/logging.h"
#include "proto/convert.h"

namespace ferry {
namespace {

std::string SourceName(const SourceOptions& options) {
  return absl::StrCat("source ", options.stream, " rank ", options.rank);
}

// Deregister's deadline in the destructor: short, because a process that is
// shutting down should not hang on a daemon that is gone; the lease runs out
// on its own anyway.
constexpr absl::Duration kDeregisterTimeout = absl::Seconds(5);

// One RegisterSource RPC; checks the lease it grants.
absl::StatusOr<v1::RegisterSourceResponse> SendRegisterSource(
    const Connection& connection, const v1::RegisterSourceRequest& request,
    const std::string& who) {
  v1::RegisterSourceResponse response;
  auto context = connection.NewContext();
  const grpc::Status s =
      connection.registry().RegisterSource(context.get(), request, &response);
  if (!s.ok()) return FromGrpcStatus(s, absl::StrCat("RegisterSource(", who, ")"));
  if (response.lease_duration_ms() <= 0) {
    return absl::InternalError(absl::StrCat(
        "RegisterSource(", who, "): the daemon returned lease ",
        response.lease_duration_ms(), " ms"));
  }
  return response;
}

// The daemon does not know (or cannot be asked about) this registration:
// worth registering again.
bool RegistrationLost(const absl::Status& s) {
  return absl::IsNotFound(s) || absl::IsPermissionDenied(s) ||
         absl::IsUnavailable(s);
}

}  // namespace

bool PublishOutcome::all_committed() const {
  for (const v1::InstanceStatus& s : instances) {
    if (s.state() != v1::INSTANCE_STATE_COMMITTED) return false;
  }
  return true;
}

std::string PublishOutcome::Summary() const {
  int committed = 0;
  std::vector<std::string> aborted;
  for (const v1::InstanceStatus& s : instances) {
    if (s.state() == v1::INSTANCE_STATE_COMMITTED) {
      ++committed;
    } else {
      aborted.push_back(absl::StrCat(
          s.adapter_name().empty()
              ? s.instance_id()
              : absl::StrCat(s.base_instance_id(), " adapter ", s.adapter_name()),
          ": ",
                                     v1::InstanceState_Name(s.state()), " ",
                                     s.abort_reason(),
                                     s.dirty() ? " (dirty)" : ""));
    }
  }
  std::string out = absl::StrCat("version ", version, ": ", committed,
                                 " committed, ", aborted.size(), " aborted");
  if (!aborted.empty()) absl::StrAppend(&out, " (", absl::StrJoin(aborted, "; "), ")");
  return out;
}

absl::Status ValidateSourceRegistration(const SourceOptions& options,
                                        const SourceLayout& layout) {
  if (absl::Status s = ValidateName("stream", options.stream); !s.ok()) {
    return s;
  }
  if (!options.node.empty()) {
    if (absl::Status s = ValidateName("node", options.node); !s.ok()) return s;
  }
  const std::string who = SourceName(options);
  if (absl::Status s = CheckRankInGroup(who, "rank", options.rank,
                                        "world_size", options.world_size);
      !s.ok()) {
    return s;
  }
  if (layout.model.params.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(who, ": declares no parameters"));
  }
  absl::flat_hash_map<uint32_t, int64_t> sizes;
  absl::StatusOr<std::vector<RegionDecl>> regions =
      CheckClientRegions(who, layout.regions, &sizes);
  if (!regions.ok()) return regions.status();
  if (absl::Status s = CheckModel(who, layout.model); !s.ok()) return s;
  // The rest is the daemon's own check of the registration, step (c) of its
  // walk (core/registration_rules.h), on the same struct it converts to.
  SourceRegistration r;
  r.stream = options.stream;
  r.node = options.node;
  r.rank = options.rank;
  r.world_size = options.world_size;
  r.pid = options.pid;
  // Borrowed, not copied (a model may hold 100,000+ parameters): `layout`
  // outlives the call.
  r.model = std::shared_ptr<const ModelSpec>(std::shared_ptr<void>(),
                                             &layout.model);
  r.regions = *std::move(regions);
  r.pieces = layout.pieces;
  return CheckSourceRegistration(&r);
}

absl::StatusOr<v1::SourceRegistration> BuildSourceRegistration(
    const SourceOptions& options, const SourceLayout& layout) {
  v1::SourceRegistration r;
  r.set_stream(options.stream);
  r.set_rank(options.rank);
  r.set_world_size(options.world_size);
  r.set_node(options.node);
  *r.mutable_device() = DeviceOfRegions(layout.regions);
  r.set_pid(options.pid != 0 ? options.pid : getpid());
  for (const v1::MemoryRegion& region : layout.regions) {
    *r.add_regions() = region;
  }
  for (const ParamSpec& p : layout.model.params) {
    *r.add_parameters() = ParamSpecToProto(p);
  }
  for (const Piece& piece : layout.pieces) {
    absl::StatusOr<v1::Piece> wire = PieceToProto(piece, layout.model);
    if (!wire.ok()) return wire.status();
    *r.add_pieces() = *std::move(wire);
  }
  return r;
}

absl::StatusOr<std::unique_ptr<SourceClient>> SourceClient::Register(
    const Connection& connection, const SourceOptions& options,
    const SourceLayout& layout) {
  if (absl::Status s = ValidateSourceRegistration(options, layout); !s.ok()) {
    return s;
  }
  v1::RegisterSourceRequest request;
  absl::StatusOr<v1::SourceRegistration> registration =
      BuildSourceRegistration(options, layout);
  if (!registration.ok()) return registration.status();
  *request.mutable_source() = *std::move(registration);
  request.set_replace_existing(options.replace_existing);

  absl::StatusOr<v1::RegisterSourceResponse> response =
      SendRegisterSource(connection, request, SourceName(options));
  if (!response.ok()) return response.status();
  LOG(INFO) << SourceName(options) << " registered as "
            << response->handle().participant_id() << " ("
            << layout.pieces.size() << " pieces, lease "
            << response->lease_duration_ms() << " ms)";
  return std::unique_ptr<SourceClient>(new SourceClient(
      connection, options, std::move(request), *std::move(response)));
}

SourceClient::SourceClient(Connection connection, SourceOptions options,
                           v1::RegisterSourceRequest request,
                           v1::RegisterSourceResponse response)
    : connection_(std::move(connection)),
      options_(std::move(options)),
      request_(std::move(request)),
      who_(SourceName(options_)) {
  request_.set_replace_existing(false);
  {
    absl::MutexLock lock(&mu_);
    handle_ = response.handle();
    lease_ = NewLeaseKeeper(handle_, response.lease_duration_ms());
  }
  rejoin_ = std::thread([this] { RejoinLoop(); });
}

std::unique_ptr<LeaseKeeper> SourceClient::NewLeaseKeeper(
    const v1::ParticipantHandle& h, int64_t lease_ms) {
  return std::make_unique<LeaseKeeper>(
      connection_, h, absl::Milliseconds(lease_ms), who_, [this] {
        absl::MutexLock lock(&mu_);
        lease_lost_ = true;
      });
}

void SourceClient::RejoinLoop() {
  absl::Duration backoff = absl::Milliseconds(200);
  while (true) {
    v1::ParticipantHandle lost;
    {
      absl::MutexLock lock(&mu_);
      auto wake = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || lease_lost_;
      };
      mu_.Await(absl::Condition(&wake));
      if (stopping_) return;
      lease_lost_ = false;
      lost = handle_;
    }
    while (true) {
      const absl::Status s = Reregister(lost, absl::Seconds(1));
      if (s.ok()) break;
      if (!absl::IsUnavailable(s) && !absl::IsDeadlineExceeded(s)) {
        // The next BeginVersion tries again and reports it.
        LOG(ERROR) << who_ << ": registering again: " << s;
        break;
      }
      absl::MutexLock lock(&mu_);
      auto stop = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) { return stopping_; };
      mu_.AwaitWithTimeout(absl::Condition(&stop), backoff);
      if (stopping_) return;
      backoff = std::min(backoff * 2, absl::Seconds(5));
    }
    backoff = absl::Milliseconds(200);
  }
}

v1::ParticipantHandle SourceClient::handle() const {
  absl::MutexLock lock(&mu_);
  return handle_;
}

absl::Status SourceClient::lease_status() const {
  absl::MutexLock lock(&mu_);
  return lease_->status();
}

int SourceClient::reregistrations() const {
  absl::MutexLock lock(&mu_);
  return reregistrations_;
}

absl::Status SourceClient::Reregister(const v1::ParticipantHandle& lost,
                                      absl::Duration ready_timeout) {
  absl::MutexLock once(&reregister_mu_);
  {
    absl::MutexLock lock(&mu_);
    if (handle_.participant_id() != lost.participant_id() ||
        handle_.token() != lost.token()) {
      return absl::OkStatus();  // registered again meanwhile
    }
  }
  absl::Status ready = connection_.WaitForReady(ready_timeout);
  if (!ready.ok()) return ready;
  absl::StatusOr<v1::RegisterSourceResponse> response =
      SendRegisterSource(connection_, request_, who_);
  if (!response.ok()) return response.status();
  std::unique_ptr<LeaseKeeper> old;
  {
    absl::MutexLock lock(&mu_);
    old = std::move(lease_);
    handle_ = response->handle();
    lease_ = NewLeaseKeeper(handle_, response->lease_duration_ms());
    lease_lost_ = false;
    ++reregistrations_;
  }
  LOG(WARNING) << who_ << ": the daemon had lost the registration; registered "
               << "again as " << response->handle().participant_id();
  return absl::OkStatus();  // `old` stops here, outside the lock
}

SourceClient::~SourceClient() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  rejoin_.join();
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
}

absl::StatusOr<std::vector<std::string>> SourceClient::BeginVersion(
    int64_t version) {
  if (version <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        who_, ": version ", version, " must be > 0"));
  }
  const v1::ParticipantHandle used = handle();
  absl::StatusOr<std::vector<std::string>> begun = BeginOnce(version);
  if (begun.ok() || !RegistrationLost(begun.status())) return begun;
  LOG(WARNING) << begun.status() << "; registering again";
  if (absl::Status s = Reregister(used, connection_.rpc_timeout()); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(begun.status().message(),
                                               "; registering again: ",
                                               s.message()));
  }
  return BeginOnce(version);
}

absl::StatusOr<std::vector<std::string>> SourceClient::BeginOnce(
    int64_t version) {
  v1::BeginVersionRequest request;
  *request.mutable_handle() = handle();
  request.set_version(version);
  v1::BeginVersionResponse response;
  auto context = connection_.NewContext();
  const grpc::Status s =
      connection_.versions().BeginVersion(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s, absl::StrCat("BeginVersion(", version, ") of ", who_));
  }
  return std::vector<std::string>(response.instance_ids().begin(),
                                  response.instance_ids().end());
}

absl::StatusOr<PublishOutcome> SourceClient::CommitVersion(int64_t version) {
  v1::CommitVersionRequest request;
  *request.mutable_handle() = handle();
  request.set_version(version);
  v1::CommitVersionResponse response;
  auto context = connection_.NewContext(options_.commit_timeout);
  const grpc::Status s =
      connection_.versions().CommitVersion(context.get(), request, &response);
  if (!s.ok()) {
    return FromGrpcStatus(s,
                          absl::StrCat("CommitVersion(", version, ") of ", who_));
  }
  PublishOutcome outcome;
  outcome.version = version;
  outcome.instances.assign(response.instances().begin(),
                           response.instances().end());
  return outcome;
}

absl::Status SourceClient::AbortVersion(int64_t version,
                                        const std::string& reason) {
  v1::AbortVersionRequest request;
  *request.mutable_handle() = handle();
  request.set_version(version);
  request.set_reason(reason.empty() ? "aborted by the trainer" : reason);
  v1::AbortVersionResponse response;
  auto context = connection_.NewContext();
  return FromGrpcStatus(
      connection_.versions().AbortVersion(context.get(), request, &response),
      absl::StrCat("AbortVersion(", version, ") of ", who_));
}

absl::StatusOr<PublishOutcome> SourceClient::PublishVersion(int64_t version) {
  absl::StatusOr<std::vector<std::string>> instances = BeginVersion(version);
  if (!instances.ok()) return instances.status();
  return CommitVersion(version);
}

}  // namespace ferry
