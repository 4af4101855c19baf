#include "proto/request_limits.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "core/checked_math.h"
#include "core/limits.h"
#include "proto/convert.h"

namespace ferry {
namespace {

constexpr const char* kSee = " (docs/api.md, \"Limits\")";

std::string Item(absl::string_view field, absl::string_view name, int i) {
  return absl::StrCat(field, ".", name, "[", i, "]");
}

std::string Sub(absl::string_view field, absl::string_view name) {
  return absl::StrCat(field, ".", name);
}

absl::Status TooMany(absl::string_view field, int64_t n, int64_t limit) {
  return absl::ResourceExhaustedError(absl::StrCat(
      field, " has ", n, " entries; at most ", limit, " are allowed", kSee));
}

absl::Status Count(absl::string_view field, int n, int64_t limit) {
  if (n <= limit) return absl::OkStatus();
  return TooMany(field, n, limit);
}

absl::Status Bytes(absl::string_view field, absl::string_view value,
                   size_t limit) {
  if (value.size() <= limit) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(field, " ", Quote(value), " is ", value.size(),
                   " bytes; at most ", limit, " are allowed", kSee));
}

absl::Status ParameterName(absl::string_view field, absl::string_view name) {
  return Bytes(field, name, Limits::kMaxParameterNameBytes);
}

// Dimensions (a shape, a box's offsets or extents, strides): at most
// kMaxDims entries, none above kMaxExtent (`bounded`; strides are not).
// Negative entries are left to the conversions, which name them.
absl::Status DimList(absl::string_view field,
                     const google::protobuf::RepeatedField<int64_t>& values,
                     bool bounded) {
  if (static_cast<size_t>(values.size()) > Limits::kMaxDims) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, " has ", values.size(), " dimensions; at most ",
                     Limits::kMaxDims, " are allowed", kSee));
  }
  if (!bounded) return absl::OkStatus();
  for (int i = 0; i < values.size(); ++i) {
    if (values[i] > Limits::kMaxExtent) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, "[", i, "] is ", values[i], "; at most ", Limits::kMaxExtent,
          " (2^40 - 1) is allowed", kSee));
    }
  }
  return absl::OkStatus();
}

// A shape: DimList, and at most kMaxParamElements elements in all.
absl::Status Shape(absl::string_view field,
                   const google::protobuf::RepeatedField<int64_t>& shape) {
  absl::Status s = DimList(field, shape, /*bounded=*/true);
  if (!s.ok()) return s;
  int64_t elements = 1;
  for (int64_t d : shape) {
    if (d < 0) return absl::OkStatus();  // named by the conversion
    if (!CheckedMul(elements, d, &elements) ||
        elements > Limits::kMaxParamElements) {
      return absl::InvalidArgumentError(absl::StrCat(
          field, " has more than ", Limits::kMaxParamElements,
          " (2^40) elements", kSee));
    }
  }
  return absl::OkStatus();
}

absl::Status Device(absl::string_view field, const v1::Device& device) {
  return Bytes(Sub(field, "cuda_uuid"), device.cuda_uuid(),
               Limits::kMaxIdBytes);
}

absl::Status Regions(absl::string_view field,
                     const google::protobuf::RepeatedPtrField<v1::MemoryRegion>&
                         regions) {
  absl::Status s = Count(field, regions.size(),
                         Limits::kMaxRegionsPerRegistration);
  if (!s.ok()) return s;
  for (int i = 0; i < regions.size(); ++i) {
    const v1::MemoryRegion& r = regions[i];
    const std::string path = absl::StrCat(field, "[", i, "]");
    if (r.has_shared_memory()) {
      s = Bytes(Sub(path, "shared_memory.shm_name"),
                r.shared_memory().shm_name(), Limits::kMaxShmNameBytes);
      if (s.ok()) {
        s = Bytes(Sub(path, "shared_memory.file_path"),
                  r.shared_memory().file_path(), Limits::kMaxFilePathBytes);
      }
    } else if (r.has_cuda_ipc()) {
      s = Bytes(Sub(path, "cuda_ipc.ipc_handle"), r.cuda_ipc().ipc_handle(),
                Limits::kMaxIpcHandleBytes);
      if (s.ok()) s = Device(Sub(path, "cuda_ipc.device"), r.cuda_ipc().device());
    }
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Pieces(absl::string_view field,
                    const google::protobuf::RepeatedPtrField<v1::Piece>& pieces) {
  absl::Status s = Count(field, pieces.size(),
                         Limits::kMaxPiecesPerRegistration);
  if (!s.ok()) return s;
  for (int i = 0; i < pieces.size(); ++i) {
    const v1::Piece& p = pieces[i];
    const std::string path = absl::StrCat(field, "[", i, "]");
    s = ParameterName(Sub(path, "parameter"), p.parameter());
    if (s.ok()) s = DimList(Sub(path, "box.offset"), p.box().offset(), true);
    if (s.ok()) s = DimList(Sub(path, "box.extent"), p.box().extent(), true);
    if (s.ok()) s = DimList(Sub(path, "strides"), p.strides(), false);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

absl::Status Size(absl::string_view field, int64_t value, int64_t limit) {
  if (value <= limit) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      field, " ", value, " is above the limit ", limit, kSee));
}

}  // namespace

absl::Status CheckOptionalName(absl::string_view field,
                               absl::string_view value) {
  if (value.empty()) return absl::OkStatus();
  return ValidateName(field, value);
}

absl::Status CheckSourceLimits(const v1::SourceRegistration& source,
                               absl::string_view field) {
  absl::Status s = ValidateName(Sub(field, "stream"), source.stream());
  if (s.ok()) s = CheckOptionalName(Sub(field, "node"), source.node());
  if (s.ok()) {
    s = Size(Sub(field, "world_size"), source.world_size(),
             Limits::kMaxWorldSize);
  }
  if (s.ok()) s = Device(Sub(field, "device"), source.device());
  if (s.ok()) s = Regions(Sub(field, "regions"), source.regions());
  if (s.ok()) {
    s = Count(Sub(field, "parameters"), source.parameters_size(),
              Limits::kMaxParamsPerRegistration);
  }
  for (int i = 0; s.ok() && i < source.parameters_size(); ++i) {
    const v1::ParameterSpec& p = source.parameters(i);
    const std::string path = Item(field, "parameters", i);
    s = ParameterName(Sub(path, "name"), p.name());
    if (s.ok()) s = Shape(Sub(path, "shape"), p.shape());
  }
  if (s.ok()) s = Pieces(Sub(field, "pieces"), source.pieces());
  return s;
}

absl::Status CheckDestinationLimits(const v1::DestinationRegistration& d,
                                    absl::string_view field) {
  absl::Status s = ValidateName(Sub(field, "instance_id"), d.instance_id());
  if (s.ok()) s = ValidateName(Sub(field, "stream"), d.stream());
  if (s.ok()) s = CheckOptionalName(Sub(field, "node"), d.node());
  if (s.ok()) s = Size(Sub(field, "tp_size"), d.tp_size(), Limits::kMaxTpSize);
  if (s.ok()) s = Device(Sub(field, "device"), d.device());
  if (s.ok()) s = Regions(Sub(field, "regions"), d.regions());
  if (!s.ok()) return s;
  if (d.has_explicit_pieces()) {
    return Pieces(Sub(field, "explicit_pieces.pieces"),
                  d.explicit_pieces().pieces());
  }
  const std::string table = Sub(field, "engine_table.parameters");
  const auto& params = d.engine_table().parameters();
  s = Count(table, params.size(), Limits::kMaxEngineParamsPerRegistration);
  for (int i = 0; s.ok() && i < params.size(); ++i) {
    const v1::EngineParameter& p = params[i];
    const std::string path = absl::StrCat(table, "[", i, "]");
    s = ParameterName(Sub(path, "name"), p.name());
    if (s.ok()) s = Shape(Sub(path, "local_shape"), p.local_shape());
    if (s.ok()) s = ParameterName(Sub(path, "alias_of"), p.alias_of());
    if (s.ok()) {
      s = ParameterName(Sub(path, "fp8.scale_parameter"),
                        p.fp8().scale_parameter());
    }
    if (s.ok()) {
      s = Count(Sub(path, "fused_parts"), p.fused_parts_size(),
                Limits::kMaxPartsPerEngineParam);
    }
    for (int k = 0; s.ok() && k < p.fused_parts_size(); ++k) {
      const std::string part = Item(path, "fused_parts", k);
      s = ParameterName(Sub(part, "checkpoint_name"),
                        p.fused_parts(k).checkpoint_name());
      if (s.ok()) {
        s = DimList(Sub(part, "lead_index"), p.fused_parts(k).lead_index(),
                    true);
      }
    }
    if (s.ok()) {
      s = Count(Sub(path, "consumes"), p.consumes_size(),
                Limits::kMaxPartsPerEngineParam);
    }
    for (int k = 0; s.ok() && k < p.consumes_size(); ++k) {
      s = ParameterName(Item(path, "consumes", k), p.consumes(k));
    }
  }
  return s;
}

absl::Status CheckHandleLimits(const v1::ParticipantHandle& handle,
                               absl::string_view field) {
  absl::Status s = Bytes(Sub(field, "participant_id"), handle.participant_id(),
                         Limits::kMaxIdBytes);
  if (!s.ok()) return s;
  // The token is a secret: its length is named, never its bytes.
  if (handle.token().size() > Limits::kMaxIdBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".token is ", handle.token().size(), " bytes; at most ",
        Limits::kMaxIdBytes, " are allowed", kSee));
  }
  return absl::OkStatus();
}

absl::Status CheckConfigLimits(const v1::UpdateConfigRequest& request) {
  absl::Status s = Count("set_options + clear_options",
                         request.set_options_size() + request.clear_options_size(),
                         Limits::kMaxConfigOptions);
  for (const auto& [key, value] : request.set_options()) {
    if (s.ok()) s = Bytes("set_options key", key, Limits::kMaxNameBytes);
    if (s.ok()) {
      s = Bytes(absl::StrCat("set_options[", Quote(key), "]"), value,
                Limits::kMaxNameBytes);
    }
  }
  for (int i = 0; s.ok() && i < request.clear_options_size(); ++i) {
    s = Bytes(absl::StrCat("clear_options[", i, "]"), request.clear_options(i),
              Limits::kMaxNameBytes);
  }
  return s;
}

absl::Status CheckAdapterConfigLimits(absl::string_view config_json) {
  return Bytes("adapter_config_json", config_json,
               Limits::kMaxAdapterConfigBytes);
}

absl::Status CheckReasonLimits(absl::string_view field,
                               absl::string_view text) {
  return Bytes(field, text, Limits::kMaxReasonBytes);
}

absl::Status CheckAckLimits(const v1::AckRequest& request) {
  absl::Status s = CheckHandleLimits(request.handle());
  if (s.ok()) s = CheckReasonLimits("error_message", request.error_message());
  return s;
}

absl::Status CheckAckBatchLimits(const v1::AckBatchRequest& request) {
  if (request.acks_size() == 0) {
    return absl::InvalidArgumentError("AckBatch: acks is empty");
  }
  return Count("acks", request.acks_size(), Limits::kMaxAcksPerBatch);
}

absl::Status CheckHeartbeatBatchLimits(
    const v1::HeartbeatBatchRequest& request) {
  if (request.heartbeats_size() == 0) {
    return absl::InvalidArgumentError("HeartbeatBatch: heartbeats is empty");
  }
  return Count("heartbeats", request.heartbeats_size(),
               Limits::kMaxHeartbeatsPerBatch);
}

absl::Status CheckSubscribeRelayLimits(
    const v1::SubscribeRelayRequest& request) {
  absl::Status s = Count("open + close",
                         request.open_size() + request.close_size(),
                         Limits::kMaxRelayChangesPerMessage);
  for (int i = 0; s.ok() && i < request.open_size(); ++i) {
    if (request.open(i).id() == 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "SubscribeRelay: open[", i, "].id must be > 0"));
    }
    s = CheckHandleLimits(request.open(i).handle(),
                          absl::StrCat("open[", i, "].handle"));
  }
  return s;
}

absl::Status CheckUpdateRegionsLimits(const v1::UpdateRegionsRequest& request) {
  absl::Status s = CheckHandleLimits(request.handle());
  if (s.ok()) s = Regions("regions", request.regions());
  return s;
}

absl::Status CheckManageMemoryLimits(const v1::ManageMemoryRequest& request) {
  absl::Status s = Count("participant_ids", request.participant_ids_size(),
                         Limits::kMaxParticipantsPerDaemon);
  for (int i = 0; s.ok() && i < request.participant_ids_size(); ++i) {
    s = Bytes(Item("", "participant_ids", i).substr(1),
              request.participant_ids(i), Limits::kMaxIdBytes);
  }
  if (s.ok()) {
    s = Bytes("engine_participant_id", request.engine_participant_id(),
              Limits::kMaxIdBytes);
  }
  // An adapter's staging: at most what one registration may describe.
  if (s.ok() && (request.bytes() < 0 ||
                 request.bytes() > Limits::kMaxAdapterStagingBytes)) {
    s = absl::InvalidArgumentError(absl::StrCat(
        "bytes ", request.bytes(), " is outside [0, ",
        Limits::kMaxAdapterStagingBytes, "]"));
  }
  return s;
}

absl::Status CheckHashBoxesLimits(const v1::HashBoxesRequest& request) {
  absl::Status s =
      Count("boxes", request.boxes_size(), Limits::kMaxBoxesPerHashCall);
  for (int i = 0; s.ok() && i < request.boxes_size(); ++i) {
    const v1::TransferBox& b = request.boxes(i);
    const std::string path = Item("", "boxes", i).substr(1);
    s = Bytes(Sub(path, "participant_id"), b.participant_id(),
              Limits::kMaxIdBytes);
    if (s.ok()) s = DimList(Sub(path, "extent"), b.extent(), /*bounded=*/true);
    if (s.ok()) s = DimList(Sub(path, "strides"), b.strides(), /*bounded=*/false);
  }
  return s;
}

}  // namespace ferry
