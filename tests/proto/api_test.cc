// The ferry.v1 API as generated: messages round-trip, every service has the
// methods docs/api.md lists, and the wire dtype enum matches core's.
#include <catch2/catch.hpp>

#include <cctype>
#include <set>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "google/protobuf/descriptor.h"
#include "proto/ferry/v1/inspection.grpc.pb.h"
#include "proto/ferry/v1/lifecycle.grpc.pb.h"
#include "proto/ferry/v1/peer.grpc.pb.h"
#include "proto/ferry/v1/registration.grpc.pb.h"
#include "proto/ferry/v1/types.pb.h"
#include "proto/ferry/v1/version.grpc.pb.h"

namespace ferry {
namespace {

using google::protobuf::DescriptorPool;
using google::protobuf::MethodDescriptor;
using google::protobuf::ServiceDescriptor;

// A source rank holding the first half (rows) of a [4096, 1024] bf16 weight
// in one shared-memory region.
v1::RegisterSourceRequest MakeSourceRequest() {
  v1::RegisterSourceRequest request;
  v1::SourceRegistration* source = request.mutable_source();
  source->set_stream("policy");
  source->set_rank(3);
  source->set_world_size(8);
  source->set_node("node-a");
  source->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  source->set_pid(4242);

  v1::MemoryRegion* region = source->add_regions();
  region->set_region_id(7);
  region->set_size_bytes(int64_t{2048} * 1024 * 2);
  region->mutable_shared_memory()->set_shm_name("/ferry.policy.3.7");

  v1::ParameterSpec* param = source->add_parameters();
  param->set_name("model.layers.0.self_attn.q_proj.weight");
  param->set_dtype(v1::DTYPE_BF16);
  param->add_shape(4096);
  param->add_shape(1024);

  v1::Piece* piece = source->add_pieces();
  piece->set_parameter("model.layers.0.self_attn.q_proj.weight");
  piece->mutable_box()->add_offset(2048);
  piece->mutable_box()->add_offset(0);
  piece->mutable_box()->add_extent(2048);
  piece->mutable_box()->add_extent(1024);
  piece->set_region_id(7);
  piece->set_byte_offset(0);
  piece->add_strides(1024);
  piece->add_strides(1);
  return request;
}

TEST_CASE("a source registration with a piece round-trips") {
  const v1::RegisterSourceRequest sent = MakeSourceRequest();
  std::string wire;
  REQUIRE(sent.SerializeToString(&wire));

  v1::RegisterSourceRequest received;
  REQUIRE(received.ParseFromString(wire));
  const v1::SourceRegistration& source = received.source();
  CHECK(source.stream() == "policy");
  CHECK(source.rank() == 3);
  CHECK(source.world_size() == 8);
  CHECK(source.device().kind() == v1::DEVICE_KIND_HOST);
  REQUIRE(source.regions_size() == 1);
  CHECK(source.regions(0).memory_case() == v1::MemoryRegion::kSharedMemory);
  CHECK(source.regions(0).shared_memory().shm_name() == "/ferry.policy.3.7");
  REQUIRE(source.pieces_size() == 1);
  const v1::Piece& piece = source.pieces(0);
  CHECK(piece.parameter() == "model.layers.0.self_attn.q_proj.weight");
  CHECK(std::vector<int64_t>(piece.box().offset().begin(),
                             piece.box().offset().end()) ==
        std::vector<int64_t>{2048, 0});
  CHECK(std::vector<int64_t>(piece.box().extent().begin(),
                             piece.box().extent().end()) ==
        std::vector<int64_t>{2048, 1024});
  CHECK(piece.region_id() == 7);
  CHECK(piece.strides_size() == 2);
  CHECK(received.SerializeAsString() == wire);
}

TEST_CASE("a destination registration carries an engine table or pieces") {
  v1::RegisterDestinationRequest request;
  v1::DestinationRegistration* dest = request.mutable_destination();
  dest->set_instance_id("vllm-0");
  dest->set_stream("policy");
  dest->set_tp_rank(1);
  dest->set_tp_size(2);
  v1::Device* device = dest->mutable_device();
  device->set_kind(v1::DEVICE_KIND_CUDA);
  device->set_cuda_uuid("GPU-00000000-0000-0000-0000-000000000001");
  v1::MemoryRegion* region = dest->add_regions();
  region->set_region_id(0);
  region->set_size_bytes(1 << 20);
  region->mutable_cuda_ipc()->set_ipc_handle(std::string(64, '\x5a'));
  *region->mutable_cuda_ipc()->mutable_device() = *device;

  v1::EngineParameter* qkv = dest->mutable_engine_table()->add_parameters();
  qkv->set_name("model.layers.0.self_attn.qkv_proj.weight");
  qkv->set_dtype(v1::DTYPE_BF16);
  qkv->set_loader(v1::LOADER_KIND_FUSED);
  qkv->set_loader_tp_size(2);
  qkv->add_flags(v1::LOADER_FLAG_PACKED);
  qkv->add_fused_parts()->set_checkpoint_name(
      "model.layers.0.self_attn.q_proj.weight");

  v1::RegisterDestinationRequest received;
  REQUIRE(received.ParseFromString(request.SerializeAsString()));
  CHECK(received.destination().layout_case() ==
        v1::DestinationRegistration::kEngineTable);
  CHECK(received.destination().regions(0).cuda_ipc().ipc_handle().size() ==
        64);
  CHECK(received.destination().engine_table().parameters(0).flags(0) ==
        v1::LOADER_FLAG_PACKED);

  // Setting the other arm of the oneof replaces the table.
  dest->mutable_explicit_pieces()->add_pieces()->set_parameter("x");
  CHECK(dest->layout_case() == v1::DestinationRegistration::kExplicitPieces);
  CHECK_FALSE(dest->has_engine_table());
}

// The methods of a service, by name.
std::set<std::string> MethodNames(const std::string& service_full_name) {
  const ServiceDescriptor* service =
      DescriptorPool::generated_pool()->FindServiceByName(service_full_name);
  std::set<std::string> names;
  if (service == nullptr) return names;
  for (int i = 0; i < service->method_count(); ++i) {
    names.insert(service->method(i)->name());
  }
  return names;
}

TEST_CASE("every service has the methods docs/api.md lists") {
  CHECK(std::string(v1::Registry::service_full_name()) == "ferry.v1.Registry");
  CHECK(MethodNames(v1::Registry::service_full_name()) ==
        std::set<std::string>{"RegisterSource", "RegisterDestination",
                              "Deregister", "Heartbeat", "HeartbeatBatch",
                              "UpdateRegions"});

  CHECK(std::string(v1::Versions::service_full_name()) == "ferry.v1.Versions");
  CHECK(MethodNames(v1::Versions::service_full_name()) ==
        std::set<std::string>{"BeginVersion", "CommitVersion", "AbortVersion",
                              "Subscribe", "SubscribeRelay", "Ack", "AckBatch",
                              "WaitForVersion"});

  CHECK(std::string(v1::Inspection::service_full_name()) ==
        "ferry.v1.Inspection");
  CHECK(MethodNames(v1::Inspection::service_full_name()) ==
        std::set<std::string>{"ListParticipants", "ListStreams",
                              "ExplainPlan", "GetProgress", "ListVersions",
                              "GetHealth", "VerifyInstance"});

  CHECK(std::string(v1::Lifecycle::service_full_name()) ==
        "ferry.v1.Lifecycle");
  CHECK(MethodNames(v1::Lifecycle::service_full_name()) ==
        std::set<std::string>{"ReloadInPlace", "SwapModel", "UpdateConfig",
                              "LoadAdapter", "UpdateAdapter", "UnloadAdapter",
                              "Offload", "Onload"});

  CHECK(std::string(v1::Peer::service_full_name()) == "ferry.v1.Peer");
  CHECK(MethodNames(v1::Peer::service_full_name()) ==
        std::set<std::string>{"JoinCoordinator", "LeaveCoordinator",
                              "PeerHeartbeat", "OpenChannel",
                              "ForwardRegistration", "RunTransfer",
                              "HashBoxes", "BlockAmax", "ManageMemory"});
}

TEST_CASE("Subscribe and SubscribeRelay are the only streaming methods") {
  const ServiceDescriptor* versions =
      DescriptorPool::generated_pool()->FindServiceByName("ferry.v1.Versions");
  REQUIRE(versions != nullptr);
  const MethodDescriptor* subscribe = versions->FindMethodByName("Subscribe");
  REQUIRE(subscribe != nullptr);
  CHECK(subscribe->server_streaming());
  CHECK_FALSE(subscribe->client_streaming());
  CHECK(subscribe->output_type()->full_name() == "ferry.v1.UpdateEvent");
  // A member's ranks' Subscribe streams, on one call both ways.
  const MethodDescriptor* relay = versions->FindMethodByName("SubscribeRelay");
  REQUIRE(relay != nullptr);
  CHECK(relay->server_streaming());
  CHECK(relay->client_streaming());

  for (const char* name : {"ferry.v1.Registry", "ferry.v1.Versions",
                           "ferry.v1.Inspection", "ferry.v1.Lifecycle",
                           "ferry.v1.Peer"}) {
    const ServiceDescriptor* service =
        DescriptorPool::generated_pool()->FindServiceByName(name);
    REQUIRE(service != nullptr);
    for (int i = 0; i < service->method_count(); ++i) {
      const MethodDescriptor* method = service->method(i);
      if (method == subscribe || method == relay) continue;
      INFO(method->full_name());
      CHECK_FALSE(method->server_streaming());
      CHECK_FALSE(method->client_streaming());
    }
  }
}

TEST_CASE("wire dtypes have core's numbers and names") {
  const auto* dtypes = v1::DType_descriptor();
  // Every core dtype, kInvalid excluded, in enum order.
  int core_count = 0;
  for (int value = 1; value <= static_cast<int>(DType::kQ6_K); ++value) {
    ++core_count;
    const auto* wire = dtypes->FindValueByNumber(value);
    REQUIRE(wire != nullptr);
    // "DTYPE_Q4_K" <-> "q4_k".
    std::string expected = "DTYPE_";
    for (const char* c = DTypeName(static_cast<DType>(value)); *c; ++c) {
      expected += static_cast<char>(std::toupper(*c));
    }
    CHECK(wire->name() == expected);
  }
  CHECK(dtypes->value_count() == core_count + 1);  // + DTYPE_UNSPECIFIED
  CHECK(v1::DTYPE_UNSPECIFIED == static_cast<int>(DType::kInvalid));
}

TEST_CASE("an update event carries its detail in a oneof") {
  v1::UpdateEvent event;
  event.set_event_id(17);
  event.set_kind(v1::UPDATE_EVENT_KIND_APPLY);
  event.set_stream("policy");
  event.set_version(5);
  event.set_ack_timeout_ms(60000);
  v1::FallbackTensor* tensor = event.mutable_apply()->add_fallback_tensors();
  tensor->set_parameter("lm_head.weight");
  tensor->set_region_id(0x80000001u);
  v1::UpdateEvent received;
  REQUIRE(received.ParseFromString(event.SerializeAsString()));
  CHECK(received.detail_case() == v1::UpdateEvent::kApply);
  CHECK(received.apply().fallback_tensors(0).region_id() == 0x80000001u);
}

}  // namespace
}  // namespace ferry
