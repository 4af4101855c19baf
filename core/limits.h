// Limits: how much one request may ask of ferryd (docs/api.md, "Limits").
//
// ferryd runs with the rights to map every client's memory, so it must not
// trust the sizes its callers send: each limit below is enforced where a
// request enters the daemon, before any other work, with INVALID_ARGUMENT
// (a malformed or absurd value) or RESOURCE_EXHAUSTED (a legitimate kind of
// request that is too large), and the message names the field. The values
// leave a Kimi-K2-sized registration (139,583 checkpoint tensors, 256
// trainer ranks, TP16 engines; bench/plan_bench.cc) far below every limit.
//
// Error messages that echo a user string quote at most a bounded prefix of
// it (Quote below), so a 10 MB name never travels back in a status message
// (gRPC sends those in metadata, whose size is limited too).
//
// Pure, no dependencies beyond Abseil; any thread.
#ifndef FERRY_CORE_LIMITS_H_
#define FERRY_CORE_LIMITS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/strings/string_view.h"

namespace ferry {

struct Limits {
  // Streams, instance ids, node and adapter names: 1 to 128 bytes of
  // [A-Za-z0-9._-]. They become parts of ids, shm names and log lines, so
  // no '/', no spaces, nothing a shell or a path would interpret.
  static constexpr size_t kMaxNameBytes = 128;

  // Checkpoint and engine parameter names (also fused part names and
  // consumed names): Hugging Face names of the largest models in
  // shared/models are under 80 bytes; 512 leaves room for deep module
  // paths while bounding every message that names two of them.
  static constexpr size_t kMaxParameterNameBytes = 512;

  // Bytes of a user string that an error message quotes (Quote).
  static constexpr size_t kMaxQuotedBytes = 64;

  // Dimensions of a shape, box or strides: weights have 1 to 3 (a fused MoE
  // tensor adds a leading expert dim), convolutions 5; per-dimension loops
  // and boxes stay small.
  static constexpr size_t kMaxDims = 8;

  // One dimension of a shape (and so of a box): below 2^40 elements. The
  // largest tensor of a 1T-parameter model is an embedding of 1.2e9
  // elements in all; extents near 2^63 only serve overflow attacks.
  static constexpr int64_t kMaxExtent = (int64_t{1} << 40) - 1;

  // Elements of one parameter: 2^40 (2 TiB of bf16). Planning splits a
  // parameter into bucket-sized copies, so this also bounds the copies one
  // parameter can make (a 2^31 x 2^31 box made billions).
  static constexpr int64_t kMaxParamElements = int64_t{1} << 40;

  // Parameters one source registration may declare: 2^20. Kimi-K2 has
  // 139,583 tensors, and a rank may declare all of them.
  static constexpr int64_t kMaxParamsPerRegistration = int64_t{1} << 20;

  // Pieces of one registration (source pieces or explicit destination
  // pieces): 2^22. FSDP flat shards make at most 2 * ndim - 1 pieces per
  // tensor: Kimi-K2 flat-sharded is under 700,000.
  static constexpr int64_t kMaxPiecesPerRegistration = int64_t{1} << 22;

  // Engine parameters of one destination registration: 2^20, as parameters.
  static constexpr int64_t kMaxEngineParamsPerRegistration = int64_t{1} << 20;

  // Fused parts, and consumed names, of one engine parameter: a MoE w13 of
  // 384 experts has 768 parts; 2^16 is far above any model.
  static constexpr int64_t kMaxPartsPerEngineParam = int64_t{1} << 16;

  // Memory regions of one registration: 2^16, the range of region ids core
  // indexes buffers by (proto/convert.h EngineTableFromProto). Register
  // allocations, not tensors.
  static constexpr int64_t kMaxRegionsPerRegistration = int64_t{1} << 16;

  // A source registration's pieces may describe at most this many bytes per
  // byte of its regions. Pieces of one rank may share bytes (tied
  // embeddings, a broadcast with zero strides), but a few pieces over a tiny
  // region describing terabytes only make planning and staging explode.
  static constexpr int64_t kMaxDescribedBytesPerRegionByte = 4;

  // Ranks of one inference instance (tp_size): 4096. The largest
  // deployments run an instance on a few hundred GPUs.
  static constexpr int32_t kMaxTpSize = 4096;

  // Source ranks of one stream (world_size): 65,536. Today's largest
  // trainers run on tens of thousands of GPUs, every one a source rank.
  static constexpr int32_t kMaxWorldSize = 65536;

  // Free-text fields that become part of an abort_reason sent to every rank
  // (Ack.error_message, AbortVersion.reason): one line, 4096 bytes.
  static constexpr size_t kMaxReasonBytes = 4096;

  // A POSIX shared memory name: NAME_MAX (255) bytes, as shm_open allows.
  static constexpr size_t kMaxShmNameBytes = 255;

  // A file region's path (a checkpoint on disk): PATH_MAX.
  static constexpr size_t kMaxFilePathBytes = 4096;

  // Lifecycle.UpdateConfig: keys set plus keys cleared in one call. ferryd
  // knows two keys; 32 leaves room for more without letting a call carry
  // a million (each key and value a name: kMaxNameBytes).
  static constexpr int kMaxConfigOptions = 32;

  // Handle fields (participant id, token) and device ids (cuda_uuid,
  // "GPU-" and 36 characters): far below 256 bytes.
  static constexpr size_t kMaxIdBytes = 256;
  // A LoRA adapter's configuration (Lifecycle.LoadAdapter's
  // adapter_config_json, PEFT adapter_config.json: well under 4 KiB in
  // practice), sent to each engine rank with every adapter APPLY.
  static constexpr size_t kMaxAdapterConfigBytes = 64 * 1024;
  // One engine rank's shares of one adapter, in ferryd staging (a rank-64
  // adapter on every linear layer of a 70B model at TP 1 is ~1.6 GiB).
  static constexpr int64_t kMaxAdapterStagingBytes = int64_t{16} << 30;

  // A CUDA IPC handle: CUDA_IPC_HANDLE_SIZE (64) bytes.
  static constexpr size_t kMaxIpcHandleBytes = 64;

  // Rows of one ExplainPlan response (engine parameters x ranks). Past it
  // the response says how many it left out (parameters_omitted); totals
  // still cover the whole instance. 2^20 rows are about 100 MB.
  static constexpr int64_t kMaxExplainRows = int64_t{1} << 20;

  // Work the destination overlap check may spend on one rank proving that
  // pieces whose byte spans interleave (one-column pieces of one tensor)
  // write distinct bytes, in contiguous runs compared. Past it the
  // registration is refused (RESOURCE_EXHAUSTED) instead of being checked
  // for minutes. 2^22 runs (96 MiB of them) took 0.17 s of one thread at
  // -O2 (two interleaved pieces of 2^21 runs each). The fuzz build
  // (tests/fuzz/fuzz.mk defines the macro, as OSS-Fuzz does) takes 2^18:
  // under its sanitizers and comparison tracing a run costs ~2 us, and a
  // 179-byte input whose two ranks filled 2^22 runs in each check took
  // 39 s, past the fuzzer's 10 s hang limit (it has four ranks at most);
  // the same paths, exhaustion included, are reached with the smaller
  // budget.
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
  static constexpr int64_t kMaxOverlapProofRuns = int64_t{1} << 18;
#else
  static constexpr int64_t kMaxOverlapProofRuns = int64_t{1} << 22;
#endif

  // Boxes in one Peer.HashBoxes request (a coordinator splits larger sets):
  // bounds the response a member builds and the hashing one call holds.
  static constexpr int64_t kMaxBoxesPerHashCall = 32768;
  // Versions.AckBatch: acks per call (a member batches its ranks' acks).
  // Rails a daemon may use (--rails), so channels of one route between
  // two nodes.
  static constexpr size_t kMaxRails = 16;
  static constexpr int kMaxAcksPerBatch = 4096;
  // Registry.HeartbeatBatch: heartbeats per call (likewise).
  static constexpr int kMaxHeartbeatsPerBatch = 4096;
  // Versions.SubscribeRelay: opens plus closes in one message.
  static constexpr int kMaxRelayChangesPerMessage = 4096;

  // Participants one daemon holds (a coordinator also holds every member's
  // forwarded registrations): far above a 1000-GPU cluster's ranks, and a
  // bound on what a client that registers in a loop can make it keep.
  // DaemonOptions.max_participants lowers it.
  static constexpr int64_t kMaxParticipantsPerDaemon = 65536;
};

// A user string for an error message: at most kMaxQuotedBytes of it,
// C-escaped and in single quotes, followed by "...(N bytes)" when it was
// longer. "'abc'" / "'model.layers.0....'...(10485760 bytes)".
std::string Quote(absl::string_view s);

}  // namespace ferry

#endif  // FERRY_CORE_LIMITS_H_
