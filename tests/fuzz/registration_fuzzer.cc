// registration_fuzzer: ferryd's registration parsing and validation on
// arbitrary bytes, as a client or a member daemon can send them.
//
// Input: one selector byte, then a protobuf binary message. An even first
// byte: a ferry.v1.RegisterSourceRequest; odd: a RegisterDestinationRequest.
// The request goes through what RegistryService / PeerService run on it
// (daemon/registry/registration_parser.h over proto/convert.h and core/validation.h),
// with MapOptions{map_memory=false} as the coordinator parses a forwarded
// registration: regions are checked, nothing is opened; a source's
// declaration through the registry's DeclarationCache, which holds the
// trainer's (daemon/registry/declaration_cache.h). What parses is then
// added to a Registry that already holds a one-rank trainer of stream
// "policy" (registration_input.h), as RegistryService does, and the
// stream's plan is built as the PlanCache builds it (BuildStreamPlan: the
// model, engine table resolution, ValidateDestination, PlanTransfers). A
// destination of "policy" with tp_size 1 thus runs the daemon's whole path.
//
// Rejections are fine. Crashes, sanitizer reports, hangs and huge
// allocations are bugs, and so is a parsed participant that breaks what
// the parser promises (checked below: pieces and engine parameters lie in
// registered regions, buffers are dense indices).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/validation.h"
#include "daemon/registry/participant.h"
#include "daemon/plans/plan_cache.h"
#include "daemon/registry/registration_parser.h"
#include "daemon/registry/registry.h"
#include "glog/logging.h"
#include "google/protobuf/stubs/logging.h"
#include "proto/ferry/v1/registration.pb.h"
#include "tests/fuzz/registration_input.h"

namespace ferry {
namespace {

constexpr char kNode[] = "node-a";

[[noreturn]] void Broken(const char* what) {
  std::fprintf(stderr, "registration_fuzzer: invariant broken: %s\n", what);
  std::abort();
}

int32_t Regions(const Participant& p) {
  return static_cast<int32_t>(p.memory->size());
}

// What ParseSourceRegistration promises of what it accepts, then what the
// plan cache does with a complete stream.
void CheckSource(const Participant& p) {
  if (p.memory == nullptr) Broken("source without a memory map");
  if (p.memory->mapped()) Broken("map_memory=false mapped memory");
  for (const Piece& piece : p.pieces) {
    if (piece.param < 0 || piece.param >= static_cast<int32_t>(p.params->size())) {
      Broken("source piece names no declared parameter");
    }
    if (static_cast<int32_t>(piece.buffer) >= Regions(p)) {
      Broken("source piece buffer is not a dense region index");
    }
    const DType dtype = (*p.params)[piece.param].dtype;
    absl::StatusOr<int64_t> end = PieceEndByte(piece, dtype);
    if (!end.ok()) Broken("accepted source piece has no end byte");
    if (*end > p.memory->bytes(piece.buffer)) {
      Broken("accepted source piece ends past its region");
    }
  }
  if (p.world_size != 1) return;
  // A one-rank stream is complete: the plan cache builds the model (each
  // name once) and validates the sources.
  ModelSpec model;
  model.params = *p.params;
  model.BuildIndex();
  if (!ValidateModelSpec(model).ok()) {
    Broken("declared parameters passed the parser but not ValidateModelSpec");
  }
  RankLayout layout;
  layout.rank = p.rank;
  layout.node = p.node;
  layout.buffer_bytes = p.memory->sizes();
  layout.pieces = p.pieces;
  absl::StatusOr<SourceIndex> index = ValidateSources(model, {layout});
  (void)index;
}

void CheckDestination(const Participant& p) {
  if (p.memory == nullptr) Broken("destination without a memory map");
  for (const EngineParam& e : *p.engine_params) {
    if (static_cast<int32_t>(e.buffer) >= Regions(p)) {
      Broken("engine parameter buffer is not a dense region index");
    }
    if (e.byte_offset < 0 || e.byte_offset > p.memory->bytes(e.buffer)) {
      Broken("engine parameter starts outside its region");
    }
  }
  for (const Piece& piece : p.pieces) {
    if (static_cast<int32_t>(piece.buffer) >= Regions(p)) {
      Broken("explicit piece buffer is not a dense region index");
    }
    if (piece.param < 0 ||
        piece.param >= static_cast<int32_t>(p.piece_params.size())) {
      Broken("explicit piece names no parameter");
    }
  }
}

// A Registry holding the one-rank trainer, its declaration parsed through
// the registry's DeclarationCache as RegistryService parses it: a fuzzed
// source's declaration is then compared with a held one first.
std::unique_ptr<Registry> RegistryWithTrainer() {
  static const v1::SourceRegistration* const trainer =
      new v1::SourceRegistration(fuzz::Trainer());
  auto registry = std::make_unique<Registry>(absl::Hours(1), absl::Hours(1));
  absl::StatusOr<std::unique_ptr<Participant>> t = ParseSourceRegistration(
      *trainer, kNode, MapOptions{false}, registry->declaration_cache());
  if (!t.ok() || !registry->Add(*std::move(t), false).ok()) {
    Broken("the fixed trainer does not register");
  }
  return registry;
}

// What RegistryService and the PlanCache do with a parsed participant.
void Register(Registry& registry, std::unique_ptr<Participant> p,
              bool replace_existing) {
  const std::string stream = p->stream;
  if (!registry.Add(std::move(p), replace_existing).ok()) return;
  absl::StatusOr<Registry::StreamSnapshot> snapshot = registry.Snapshot(stream);
  if (!snapshot.ok()) Broken("no snapshot of a stream just registered");
  std::shared_ptr<const StreamPlan> plan = BuildStreamPlan(*snapshot);
  if (plan == nullptr) Broken("BuildStreamPlan returned nothing");
}

}  // namespace
}  // namespace ferry

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  FLAGS_minloglevel = google::GLOG_ERROR;  // the plan cache logs every plan
  // Protobuf logs every string field that is not UTF-8 (the parse then
  // fails, which is what the fuzzer needs to know).
  google::protobuf::SetLogHandler(
      [](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferry;
  if (size < 1) return 0;
  const void* wire = data + 1;
  const int wire_size = static_cast<int>(size - 1);
  const MapOptions no_mapping{/*map_memory=*/false};
  if ((data[0] & 1) == 0) {
    v1::RegisterSourceRequest request;
    if (!request.ParseFromArray(wire, wire_size)) return 0;
    if (!request.has_source()) return 0;  // RegistryService rejects it
    std::unique_ptr<Registry> registry = RegistryWithTrainer();
    absl::StatusOr<std::unique_ptr<Participant>> p = ParseSourceRegistration(
        request.source(), kNode, no_mapping, registry->declaration_cache());
    if (!p.ok()) return 0;
    CheckSource(**p);
    Register(*registry, *std::move(p), request.replace_existing());
  } else {
    v1::RegisterDestinationRequest request;
    if (!request.ParseFromArray(wire, wire_size)) return 0;
    if (!request.has_destination()) return 0;
    absl::StatusOr<std::unique_ptr<Participant>> p =
        ParseDestinationRegistration(request.destination(), kNode, no_mapping);
    if (!p.ok()) return 0;
    CheckDestination(**p);
    Register(*RegistryWithTrainer(), *std::move(p),
             request.replace_existing());
  }
  return 0;
}
