// A rank's registration in core form: what a trainer rank (source) or an
// engine rank (destination) says about itself, with no proto in sight.
//
// The second of a registration's four steps makes one of these from the
// wire message (proto/registration_convert.h), the third checks it
// (core/registration_rules.h: CheckSourceRegistration,
// CheckDestinationRegistration, the call the C++ client makes too), the
// fourth maps the memory it names and builds the daemon's Participant
// (daemon/registry/registration_parser.h). The memory handles themselves
// (shm names, memfds, CUDA IPC handles) stay on the wire message: only the
// daemon's MemoryMap opens them, so core keeps each region's id and size.
//
// Owner: whoever converted it; plain values. Threading: none of its own.
#ifndef FERRY_CORE_REGISTRATION_H_
#define FERRY_CORE_REGISTRATION_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/layout_resolution.h"
#include "core/model_spec.h"
#include "core/piece.h"

namespace ferry {

// One memory region as a registration declares it.
struct RegionDecl {
  uint32_t id = 0;            // the client's region id
  int64_t size_bytes = 0;
  bool names_memory = false;  // shared memory or a CUDA IPC allocation
};

// A trainer rank's registration.
struct SourceRegistration {
  std::string stream;
  std::string node;  // where the rank says it runs; empty: not said
  int32_t rank = 0;
  int32_t world_size = 0;
  int64_t pid = 0;
  // The declared parameters, converted and validated (ValidateModelSpec)
  // once per distinct list: the daemon's DeclarationCache holds the parsed
  // list, since a 139,583-parameter declaration took 100 ms per rank.
  // Never null once converted.
  std::shared_ptr<const ModelSpec> model;
  std::vector<RegionDecl> regions;  // as listed
  // `param` indexes model->params; `buffer` is the client's region id and
  // `strides` are as sent (empty: row-major contiguous).
  std::vector<Piece> pieces;

  // "source policy rank 3", as messages name the rank (and
  // Participant::Describe does).
  std::string Who() const {
    return absl::StrCat("source ", stream, " rank ", rank);
  }
};

// An engine rank's registration.
struct DestinationRegistration {
  enum class Layout { kNone, kEngineTable, kExplicitPieces };

  std::string instance_id;
  std::string stream;
  std::string node;  // where the rank says it runs; empty: not said
  int32_t tp_rank = 0;
  int32_t tp_size = 0;
  int64_t pid = 0;
  int64_t held_version = 0;
  bool cuda_device = false;     // the rank's device is a GPU
  bool device_staging = false;  // StagingPlacement DEVICE
  std::vector<RegionDecl> regions;  // as listed
  Layout layout = Layout::kNone;
  // kEngineTable: the parameters, `buffer` the client's region id.
  std::vector<EngineParam> engine_params;
  // kExplicitPieces: `param` indexes piece_params (names only: the stream
  // declares dtypes and shapes), `buffer` is the client's region id.
  std::vector<Piece> pieces;
  std::vector<std::string> piece_params;

  // "instance vllm-0 tp rank 1".
  std::string Who() const {
    return absl::StrCat("instance ", instance_id, " tp rank ", tp_rank);
  }
};

}  // namespace ferry

#endif  // FERRY_CORE_REGISTRATION_H_
