#include "daemon/memory/member_memory.h"

#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "daemon/memory/staging_area.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "proto/grpc_status.h"

namespace ferry {
namespace {

std::string Who(const std::string& id) {
  return absl::StrCat("participant ", id);
}

}  // namespace

// An adapter rank's staging and the map transfers write it through.
struct MemberMemory::AdapterStaging {
  std::string engine;  // the engine rank's participant id
  std::unique_ptr<StagingArea> area;
  std::shared_ptr<const MemoryMap> map;
};

absl::StatusOr<v1::ManageMemoryResponse> MemberMemory::StageAdapter(
    const v1::ManageMemoryRequest& request) {
  if (!hooks_.add || request.participant_ids_size() != 1 ||
      request.bytes() < 1 || request.engine_participant_id().empty()) {
    return absl::InvalidArgumentError(
        "ManageMemory(STAGE_ADAPTER): one participant id, bytes > 0 and the "
        "engine_participant_id are required");
  }
  const std::string& id = request.participant_ids(0);
  if (local_(request.engine_participant_id()) == nullptr) {
    return absl::NotFoundError(absl::StrCat(
        Who(request.engine_participant_id()),
        " did not register through this daemon"));
  }
  auto staging = std::make_shared<AdapterStaging>();
  staging->engine = request.engine_participant_id();
  staging->area = std::make_unique<StagingArea>(id);
  absl::Status s = staging->area->Reserve({{"shares", request.bytes()}});
  if (!s.ok()) return s;
  v1::ManageMemoryResponse response;
  *response.mutable_region() = staging->area->Exported()[0];
  google::protobuf::RepeatedPtrField<v1::MemoryRegion> regions;
  *regions.Add() = response.region();
  regions[0].set_region_id(0);
  absl::StatusOr<std::unique_ptr<MemoryMap>> map =
      MemoryMap::Map(regions, Who(id), MapOptions());
  if (!map.ok()) return map.status();
  staging->map = *std::move(map);
  hooks_.add(id, staging->map);
  absl::MutexLock lock(&mu_);
  adapters_[id] = staging;
  adapters_of_[staging->engine].insert(id);
  return response;
}

void MemberMemory::DropAdapter(const std::string& id) {
  std::shared_ptr<AdapterStaging> gone;
  {
    absl::MutexLock lock(&mu_);
    auto it = adapters_.find(id);
    if (it == adapters_.end()) return;
    gone = std::move(it->second);
    adapters_.erase(it);
    auto of = adapters_of_.find(gone->engine);
    if (of != adapters_of_.end()) {
      of->second.erase(id);
      if (of->second.empty()) adapters_of_.erase(of);
    }
  }
  if (hooks_.remove) hooks_.remove(id);
}

absl::StatusOr<v1::ManageMemoryResponse> MemberMemory::Manage(
    const v1::ManageMemoryRequest& request) {
  v1::ManageMemoryResponse response;
  int64_t bytes = 0;
  switch (request.action()) {
    case v1::MEMORY_ACTION_COPY: {
      std::vector<HostCopy::Rank> ranks;
      int64_t needed = 0;
      for (const std::string& id : request.participant_ids()) {
        std::shared_ptr<const MemoryMap> map = local_(id);
        if (map == nullptr) {
          return absl::NotFoundError(absl::StrCat(
              Who(id), " did not register through this daemon"));
        }
        needed += map->total_bytes();
        ranks.push_back(HostCopy::Rank{id, Who(id), std::move(map)});
      }
      const int64_t available = AvailableHostMemory();
      if (available >= 0 && needed > available) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "the host copy needs ", needed, " bytes and the kernel reports ",
            available, " available"));
      }
      std::map<std::string, std::shared_ptr<const HostCopy>> taken;
      for (const HostCopy::Rank& r : ranks) {
        absl::StatusOr<std::unique_ptr<HostCopy>> copy =
            HostCopy::Take({r}, request.version(), devices_, nullptr);
        if (!copy.ok()) return copy.status();
        bytes += (*copy)->bytes();
        taken[r.id] = *std::move(copy);
      }
      absl::MutexLock lock(&mu_);
      for (auto& [id, copy] : taken) copies_[id] = std::move(copy);
      response.set_bytes(bytes);
      return response;
    }
    case v1::MEMORY_ACTION_RELEASE:
      for (const std::string& id : request.participant_ids()) {
        std::shared_ptr<const MemoryMap> map = local_(id);
        if (map != nullptr) map->Release();
      }
      return response;
    case v1::MEMORY_ACTION_RESTORE:
      for (const std::string& id : request.participant_ids()) {
        std::shared_ptr<const HostCopy> copy;
        {
          absl::MutexLock lock(&mu_);
          auto it = copies_.find(id);
          if (it != copies_.end()) copy = it->second;
        }
        if (copy == nullptr) {
          return absl::NotFoundError(
              absl::StrCat(Who(id), " has no host copy on this daemon"));
        }
        absl::Status s = copy->Restore({HostCopy::Rank{id, Who(id), local_(id)}},
                                       devices_, nullptr);
        if (!s.ok()) return s;
        bytes += copy->bytes();
        absl::MutexLock lock(&mu_);
        copies_.erase(id);
      }
      response.set_bytes(bytes);
      return response;
    case v1::MEMORY_ACTION_DROP: {
      absl::MutexLock lock(&mu_);
      for (const std::string& id : request.participant_ids()) {
        copies_.erase(id);
      }
      return response;
    }
    case v1::MEMORY_ACTION_STAGE_ADAPTER:
      return StageAdapter(request);
    case v1::MEMORY_ACTION_DROP_ADAPTER:
      for (const std::string& id : request.participant_ids()) DropAdapter(id);
      return response;
    default:
      return absl::InvalidArgumentError(
          "ManageMemory: action is required (COPY, RELEASE, RESTORE, DROP, "
          "STAGE_ADAPTER, DROP_ADAPTER)");
  }
}

void MemberMemory::Forget(const std::string& participant_id) {
  std::set<std::string> adapters;
  {
    absl::MutexLock lock(&mu_);
    if (copies_.erase(participant_id) > 0) {
      LOG(INFO) << Who(participant_id) << " left; its host copy is dropped";
    }
    auto of = adapters_of_.find(participant_id);
    if (of != adapters_of_.end()) adapters = of->second;
  }
  for (const std::string& id : adapters) DropAdapter(id);
}

int64_t MemberMemory::bytes() const {
  absl::MutexLock lock(&mu_);
  int64_t total = 0;
  for (const auto& [id, copy] : copies_) total += copy->bytes();
  return total;
}

ManageRemoteMemory PeerMemoryCaller(
    std::function<std::string(const std::string&)> address_of,
    std::shared_ptr<grpc::ChannelCredentials> credentials,
    absl::Duration timeout) {
  return [address_of = std::move(address_of),
          credentials = std::move(credentials),
          timeout](const std::string& node, const v1::ManageMemoryRequest& r)
             -> absl::StatusOr<v1::ManageMemoryResponse> {
    const std::string address = address_of ? address_of(node) : "";
    if (address.empty()) {
      return absl::UnavailableError(
          absl::StrCat("node ", node, " is not a live member"));
    }
    // Mutual TLS, as every call between daemons (docs/api.md).
    auto stub = v1::Peer::NewStub(grpc::CreateChannel(address, credentials));
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    v1::ManageMemoryResponse response;
    const grpc::Status s = stub->ManageMemory(&ctx, r, &response);
    if (!s.ok()) {
      return absl::Status(FromGrpcStatus(s).code(),
                          absl::StrCat("node ", node, " ManageMemory(",
                                       v1::MemoryAction_Name(r.action()),
                                       "): ", s.error_message()));
    }
    return response;
  };
}

}  // namespace ferry
