// Writes the seed corpora of the fuzz targets:
//
//   make_seeds DIR    -> DIR/registration_fuzzer/*, DIR/layout_resolution_fuzzer/*,
//                        DIR/wire_format_fuzzer/*
//
// tools/fuzz.sh --seeds runs it with DIR = tests/fuzz/corpus; the output is
// committed. Everything is deterministic, so running it again rewrites the
// same files.
//
//   registration: valid registrations of each kind (sources: TP shard,
//     replicated, FSDP flat boxes, block-quantized, explicit strides, CUDA
//     and memfd regions; destinations: an engine table with every loader
//     kind, a MoE w13 with lead indices, explicit pieces), as the client
//     library sends them.
//   layout resolution: inputs found by a deterministic random search over
//     the fuzzer's own input builder (layout_input.h), the shortest for each
//     way a table resolves (replicated, column, row, vocab, fused, fused with
//     lead slots, and the fallbacks).
//   wire format: scenarios whose peer sends valid buckets (one box, several,
//     every destination layout, an empty bucket, buckets cut in many
//     segments), and a wrong connection token.
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/layout_resolution.h"
#include "core/validation.h"
#include "proto/ferry/v1/registration.pb.h"
#include "tests/fuzz/layout_input.h"
#include "tests/fuzz/registration_input.h"
#include "tests/fuzz/wire_input.h"
#include "transport/tcp/wire_format.h"

namespace ferry {
namespace {

void Write(const std::string& dir, const std::string& name,
           const std::string& bytes) {
  ::mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out) {
    std::fprintf(stderr, "make_seeds: cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::printf("%s (%zu bytes)\n", path.c_str(), bytes.size());
}

// --- registration_fuzzer: selector byte + protobuf binary -------------------

void AddShmRegion(google::protobuf::RepeatedPtrField<v1::MemoryRegion>* regions,
                  uint32_t id, int64_t size, const std::string& name) {
  v1::MemoryRegion* r = regions->Add();
  r->set_region_id(id);
  r->set_size_bytes(size);
  r->mutable_shared_memory()->set_shm_name(name);
}

void AddParam(v1::SourceRegistration* s, const std::string& name,
              v1::DType dtype, std::vector<int64_t> shape) {
  v1::ParameterSpec* p = s->add_parameters();
  p->set_name(name);
  p->set_dtype(dtype);
  for (int64_t d : shape) p->add_shape(d);
}

v1::Piece* AddPiece(google::protobuf::RepeatedPtrField<v1::Piece>* pieces,
                    const std::string& param, std::vector<int64_t> offset,
                    std::vector<int64_t> extent, uint32_t region,
                    int64_t byte_offset) {
  v1::Piece* p = pieces->Add();
  p->set_parameter(param);
  for (int64_t o : offset) p->mutable_box()->add_offset(o);
  for (int64_t e : extent) p->mutable_box()->add_extent(e);
  p->set_region_id(region);
  p->set_byte_offset(byte_offset);
  return p;
}

std::string Source(const v1::SourceRegistration& s, bool replace = false) {
  v1::RegisterSourceRequest request;
  *request.mutable_source() = s;
  request.set_replace_existing(replace);
  return std::string(1, '\0') + request.SerializeAsString();
}

std::string Destination(const v1::DestinationRegistration& d) {
  v1::RegisterDestinationRequest request;
  *request.mutable_destination() = d;
  return std::string(1, '\1') + request.SerializeAsString();
}

// Streams other than the fixed trainer's "policy" (registration_input.h), so
// that the source registers and its stream is planned.
v1::SourceRegistration BaseSource(const std::string& stream, int32_t rank,
                                  int32_t world) {
  v1::SourceRegistration s;
  s.set_stream(stream);
  s.set_rank(rank);
  s.set_world_size(world);
  s.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  return s;
}

v1::EngineParameter* AddEngineParam(v1::EngineParameterTable* t,
                                    const std::string& name, v1::DType dtype,
                                    std::vector<int64_t> shape,
                                    int64_t byte_offset, v1::LoaderKind loader,
                                    int32_t tp, int32_t shard_dim) {
  v1::EngineParameter* p = t->add_parameters();
  p->set_name(name);
  p->set_dtype(dtype);
  for (int64_t d : shape) p->add_local_shape(d);
  p->set_region_id(0);
  p->set_byte_offset(byte_offset);
  p->set_loader(loader);
  p->set_loader_tp_size(tp);
  p->set_shard_dim(shard_dim);
  return p;
}

void RegistrationSeeds(const std::string& dir) {
  const std::string l0 = "model.layers.0.";
  {  // One rank of TP 2: rows 8:16 of a [16, 64] bf16 weight, and a norm.
    v1::SourceRegistration s = BaseSource("policy-tp2", 1, 2);
    s.set_node("node-a");
    s.set_pid(4242);
    AddShmRegion(s.mutable_regions(), 0, 8192, "/ferry.policy.1.0");
    AddParam(&s, l0 + "self_attn.q_proj.weight", v1::DTYPE_BF16, {16, 64});
    AddParam(&s, "model.norm.weight", v1::DTYPE_F32, {64});
    AddPiece(s.mutable_pieces(), l0 + "self_attn.q_proj.weight", {8, 0},
             {8, 64}, 0, 0);
    AddPiece(s.mutable_pieces(), "model.norm.weight", {0}, {64}, 0, 1024);
    Write(dir, "source_tp_shard", Source(s));
  }
  {  // A one-rank stream that tiles every parameter, taking rank 0 of
     // "policy" over from the fixed trainer (replace_existing).
    v1::SourceRegistration s = BaseSource("policy", 0, 1);
    AddShmRegion(s.mutable_regions(), 3, 4096, "/ferry.policy.0.3");
    AddParam(&s, "model.embed_tokens.weight", v1::DTYPE_F16, {32, 16});
    AddParam(&s, "model.norm.weight", v1::DTYPE_F32, {16});
    AddPiece(s.mutable_pieces(), "model.embed_tokens.weight", {0, 0}, {32, 16},
             3, 0);
    AddPiece(s.mutable_pieces(), "model.norm.weight", {0}, {16}, 3, 1024);
    Write(dir, "source_whole_model_replacing", Source(s, /*replace=*/true));
  }
  {  // FSDP: a flat range of a [4, 10] tensor as three boxes, and explicit
     // (padded) strides.
    v1::SourceRegistration s = BaseSource("fsdp", 0, 1);
    AddShmRegion(s.mutable_regions(), 0, 4096, "/ferry.fsdp.0");
    AddParam(&s, "w", v1::DTYPE_F32, {4, 10});
    AddPiece(s.mutable_pieces(), "w", {0, 0}, {1, 10}, 0, 0);
    AddPiece(s.mutable_pieces(), "w", {1, 0}, {2, 10}, 0, 40);
    v1::Piece* p = AddPiece(s.mutable_pieces(), "w", {3, 0}, {1, 10}, 0, 512);
    p->add_strides(16);
    p->add_strides(1);
    Write(dir, "source_fsdp_strided", Source(s));
  }
  {  // Block-quantized: a Q4_K [2, 512] weight (2 blocks per row).
    v1::SourceRegistration s = BaseSource("gguf", 0, 1);
    AddShmRegion(s.mutable_regions(), 0, 4096, "/ferry.gguf.0");
    AddParam(&s, "blk.0.attn_q.weight", v1::DTYPE_Q4_K, {2, 512});
    AddPiece(s.mutable_pieces(), "blk.0.attn_q.weight", {0, 0}, {2, 512}, 0, 0);
    Write(dir, "source_q4_k", Source(s));
  }
  {  // GPU memory (CUDA IPC) and a memfd region.
    v1::SourceRegistration s = BaseSource("gpu-policy", 0, 1);
    s.mutable_device()->set_kind(v1::DEVICE_KIND_CUDA);
    s.mutable_device()->set_cuda_uuid("GPU-00000000-1111-2222-3333-444444444444");
    v1::MemoryRegion* r = s.add_regions();
    r->set_region_id(0);
    r->set_size_bytes(1 << 20);
    r->mutable_cuda_ipc()->set_ipc_handle(std::string(64, '\x5a'));
    r->mutable_cuda_ipc()->set_allocation_offset_bytes(4096);
    *r->mutable_cuda_ipc()->mutable_device() = s.device();
    v1::MemoryRegion* m = s.add_regions();
    m->set_region_id(1);
    m->set_size_bytes(8192);
    m->mutable_shared_memory()->mutable_memfd()->set_pid(77);
    m->mutable_shared_memory()->mutable_memfd()->set_fd(5);
    m->mutable_shared_memory()->set_file_offset_bytes(4096);
    AddParam(&s, "a", v1::DTYPE_BF16, {8, 8});
    AddParam(&s, "b", v1::DTYPE_I32, {8});
    AddPiece(s.mutable_pieces(), "a", {0, 0}, {8, 8}, 0, 0);
    AddPiece(s.mutable_pieces(), "b", {0}, {8}, 1, 0);
    Write(dir, "source_cuda_memfd", Source(s));
  }
  {  // An engine table with every loader kind, TP 2 rank 0 (vLLM Llama).
    v1::DestinationRegistration d;
    d.set_instance_id("vllm-0");
    d.set_stream("policy");
    d.set_tp_rank(0);
    d.set_tp_size(2);
    d.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    AddShmRegion(d.mutable_regions(), 0, 1 << 16, "/ferry.vllm-0.0");
    v1::EngineParameterTable* t = d.mutable_engine_table();
    v1::EngineParameter* qkv =
        AddEngineParam(t, l0 + "self_attn.qkv_proj.weight", v1::DTYPE_BF16,
                       {16, 32}, 0, v1::LOADER_KIND_FUSED, 2, 0);
    for (const char* part : {"q_proj", "k_proj", "v_proj"}) {
      v1::FusedPart* f = qkv->add_fused_parts();
      f->set_checkpoint_name(l0 + "self_attn." + part + ".weight");
      if (part[0] != 'q') f->set_local_extent(4);
    }
    AddEngineParam(t, l0 + "self_attn.o_proj.weight", v1::DTYPE_BF16, {32, 8},
                   1024, v1::LOADER_KIND_ROW, 2, 1);
    AddEngineParam(t, l0 + "mlp.down_proj.weight", v1::DTYPE_BF16, {32, 16},
                   2048, v1::LOADER_KIND_COLUMN, 2, 0);
    AddEngineParam(t, "model.embed_tokens.weight", v1::DTYPE_BF16, {64, 32},
                   4096, v1::LOADER_KIND_VOCAB_PARALLEL, 2, 0);
    AddEngineParam(t, "model.norm.weight", v1::DTYPE_F32, {32}, 8192,
                   v1::LOADER_KIND_REPLICATED, 2, 0);
    v1::EngineParameter* custom =
        AddEngineParam(t, l0 + "self_attn.rotary_emb.inv_freq", v1::DTYPE_F32,
                       {8}, 8448, v1::LOADER_KIND_CUSTOM, 2, 0);
    custom->add_consumes(l0 + "self_attn.rotary_emb.inv_freq");
    v1::EngineParameter* packed =
        AddEngineParam(t, l0 + "mlp.up_proj.qweight", v1::DTYPE_I32, {8, 8},
                       8704, v1::LOADER_KIND_COLUMN, 2, 0);
    packed->add_flags(v1::LOADER_FLAG_PACKED);
    packed->add_consumes(l0 + "mlp.up_proj.weight");
    Write(dir, "destination_engine_table", Destination(d));
  }
  {  // TP 1: completes an instance of the fixed trainer's stream
     // (registration_input.h), so it is resolved and planned.
    v1::DestinationRegistration d;
    d.set_instance_id("vllm-tp1");
    d.set_stream("policy");
    d.set_tp_size(1);
    d.set_pid(31337);
    d.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    v1::EngineParameterTable* t = d.mutable_engine_table();
    int64_t at = 0;
    auto add = [&](const std::string& name, v1::DType dtype,
                   std::vector<int64_t> shape, v1::LoaderKind loader,
                   int32_t shard_dim, int64_t bytes) {
      v1::EngineParameter* p =
          AddEngineParam(t, name, dtype, shape, at, loader, 1, shard_dim);
      at += bytes;
      return p;
    };
    v1::EngineParameter* qkv =
        add(l0 + "self_attn.qkv_proj.weight", v1::DTYPE_BF16, {32, 16},
            v1::LOADER_KIND_FUSED, 0, 32 * 16 * 2);
    for (const char* part : {"q_proj", "k_proj", "v_proj"}) {
      qkv->add_fused_parts()->set_checkpoint_name(l0 + "self_attn." + part +
                                                  ".weight");
    }
    add(l0 + "self_attn.o_proj.weight", v1::DTYPE_BF16, {16, 16},
        v1::LOADER_KIND_ROW, 1, 16 * 16 * 2);
    v1::EngineParameter* gate_up =
        add(l0 + "mlp.gate_up_proj.weight", v1::DTYPE_BF16, {64, 16},
            v1::LOADER_KIND_FUSED, 0, 64 * 16 * 2);
    for (const char* part : {"gate_proj", "up_proj"}) {
      gate_up->add_fused_parts()->set_checkpoint_name(l0 + "mlp." + part +
                                                      ".weight");
    }
    add(l0 + "mlp.down_proj.weight", v1::DTYPE_BF16, {16, 32},
        v1::LOADER_KIND_ROW, 1, 16 * 32 * 2);
    add("model.embed_tokens.weight", v1::DTYPE_BF16, {64, 16},
        v1::LOADER_KIND_VOCAB_PARALLEL, 0, 64 * 16 * 2);
    add("model.norm.weight", v1::DTYPE_F32, {16}, v1::LOADER_KIND_REPLICATED, 0,
        16 * 4);
    add(l0 + "self_attn.rotary_emb.inv_freq", v1::DTYPE_F32, {8},
        v1::LOADER_KIND_CUSTOM, 0, 8 * 4)
        ->add_consumes(l0 + "self_attn.rotary_emb.inv_freq");
    add("lm_head.weight", v1::DTYPE_Q8_0, {64, 32}, v1::LOADER_KIND_COLUMN, 0,
        64 * 34);
    v1::EngineParameter* w13 =
        add(l0 + "mlp.experts.w13_weight", v1::DTYPE_BF16, {2, 16, 16},
            v1::LOADER_KIND_FUSED, 0, 2 * 16 * 16 * 2);
    for (int e = 0; e < 2; ++e) {
      for (const char* w : {"w1", "w3"}) {
        v1::FusedPart* f = w13->add_fused_parts();
        f->set_checkpoint_name(l0 + "mlp.experts." + std::to_string(e) + "." +
                               w + ".weight");
        f->add_lead_index(e);
      }
    }
    AddShmRegion(d.mutable_regions(), 0, at, "/ferry.vllm-tp1.0");
    Write(dir, "destination_planned_engine_table", Destination(d));
  }
  {  // TP 1 explicit pieces of the fixed trainer's parameters: planned too.
    v1::DestinationRegistration d;
    d.set_instance_id("explicit-tp1");
    d.set_stream("policy");
    d.set_tp_size(1);
    d.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    AddShmRegion(d.mutable_regions(), 2, 4096, "/ferry.explicit-tp1.2");
    auto* pieces = d.mutable_explicit_pieces()->mutable_pieces();
    AddPiece(pieces, l0 + "self_attn.q_proj.weight", {0, 0}, {16, 16}, 2, 0);
    AddPiece(pieces, "model.norm.weight", {0}, {16}, 2, 512);
    v1::Piece* p = AddPiece(pieces, l0 + "self_attn.k_proj.weight", {4, 0},
                            {4, 16}, 2, 1024);
    p->add_strides(32);  // every other row of the region
    p->add_strides(1);
    Write(dir, "destination_planned_explicit", Destination(d));
  }
  {  // MoE: w13 of 2 experts with lead indices, TP 1.
    v1::DestinationRegistration d;
    d.set_instance_id("sglang-moe");
    d.set_stream("policy");
    d.set_tp_size(1);
    d.set_held_version(3);
    d.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    AddShmRegion(d.mutable_regions(), 0, 1 << 16, "/ferry.moe.0");
    v1::EngineParameterTable* t = d.mutable_engine_table();
    v1::EngineParameter* w13 =
        AddEngineParam(t, l0 + "mlp.experts.w13_weight", v1::DTYPE_BF16,
                       {2, 16, 16}, 0, v1::LOADER_KIND_FUSED, 1, 0);
    for (int e = 0; e < 2; ++e) {
      for (const char* w : {"w1", "w3"}) {
        v1::FusedPart* f = w13->add_fused_parts();
        f->set_checkpoint_name(l0 + "mlp.experts." + std::to_string(e) + "." +
                               w + ".weight");
        f->add_lead_index(e);
      }
    }
    Write(dir, "destination_moe_w13", Destination(d));
  }
  {  // Explicit pieces (all direct), in two regions.
    v1::DestinationRegistration d;
    d.set_instance_id("explicit-1");
    d.set_stream("policy");
    d.set_tp_rank(1);
    d.set_tp_size(2);
    d.set_node("node-a");
    d.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
    AddShmRegion(d.mutable_regions(), 0, 4096, "/ferry.explicit.0");
    AddShmRegion(d.mutable_regions(), 7, 4096, "/ferry.explicit.7");
    AddPiece(d.mutable_explicit_pieces()->mutable_pieces(),
             l0 + "self_attn.q_proj.weight", {8, 0}, {8, 16}, 0, 0);
    v1::Piece* p = AddPiece(d.mutable_explicit_pieces()->mutable_pieces(),
                            "model.norm.weight", {0}, {16}, 7, 64);
    p->add_strides(2);
    Write(dir, "destination_explicit_pieces", Destination(d));
  }
}

// --- layout_resolution_fuzzer: searched, shortest input per resolution ------

// The ways a table resolves, by the reason's first words.
std::string Kind(const ParamDecision& d) {
  static const char* const kKinds[] = {
      "replicated",          "column shard",
      "row shard",           "vocab shard",
      "fallback: module",    "fallback: loader is custom",
      "fallback: engine dtype", "fallback: local shape",
      "fallback: packed",    "fallback: engine tp_size",
      "fallback: fused parts"};
  if (d.reason.rfind("fused along", 0) == 0) {
    return d.reason.find("lead slots") != std::string::npos ? "fused_lead"
                                                            : "fused";
  }
  for (const char* k : kKinds) {
    if (d.reason.rfind(k, 0) == 0) {
      std::string name = k;
      for (char& c : name) {
        if (c == ' ' || c == ':') c = '_';
      }
      std::string out;
      for (char c : name) {
        if (c == '_' && !out.empty() && out.back() == '_') continue;
        out.push_back(c);
      }
      return out;
    }
  }
  return "";
}

void LayoutSeeds(const std::string& dir) {
  std::mt19937_64 rng(20240611);
  std::map<std::string, std::string> best;  // kind -> shortest input
  for (int trial = 0; trial < 400000; ++trial) {
    std::string input(16 + rng() % 112, '\0');
    for (char& c : input) c = static_cast<char>(rng());
    FuzzedDataProvider in(reinterpret_cast<const uint8_t*>(input.data()),
                          input.size());
    fuzz::LayoutCase c = fuzz::BuildLayoutCase(in);
    // Seeds the planner can run on: a model the daemon would accept, an
    // instance whose tables are one TP group.
    if (!ValidateModelSpec(c.model).ok()) continue;
    absl::StatusOr<ResolvedInstance> r =
        ResolveDestinationLayout(c.model, c.tables);
    if (!r.ok()) continue;
    for (const ResolvedRank& rank : r->ranks) {
      for (const ParamDecision& d : rank.decisions) {
        const std::string kind = Kind(d);
        if (kind.empty()) continue;
        auto [it, inserted] = best.emplace(kind, input);
        if (!inserted && input.size() < it->second.size()) it->second = input;
      }
    }
  }
  for (const auto& [kind, input] : best) Write(dir, kind, input);
}

// --- wire_format_fuzzer: valid buckets ---------------------------------------

// Appends a valid bucket for `spec` to `s->stream` (payload bytes 0, 1, ...
// from `seed`) and the spec to the scenario.
void AddBucket(fuzz::WireScenario* s, const fuzz::BucketSpec& spec,
               uint8_t seed) {
  std::string payload;
  for (const fuzz::BoxSpec& box : spec.boxes) {
    for (int64_t i = 0; i < fuzz::WireBytes(box); ++i) {
      payload.push_back(static_cast<char>(seed + 7 * i));
    }
  }
  BucketHeader h;
  h.bucket_id = spec.id;
  h.payload_bytes = payload.size();
  uint8_t header[kBucketHeaderBytes];
  EncodeBucketHeader(h, header);
  uint8_t trailer[kBucketTrailerBytes];
  EncodeBucketTrailer(
      ChecksumOf(reinterpret_cast<const uint8_t*>(payload.data()),
                 payload.size()),
      trailer);
  s->stream.append(reinterpret_cast<const char*>(header), sizeof(header));
  s->stream += payload;
  s->stream.append(reinterpret_cast<const char*>(trailer), sizeof(trailer));
  s->buckets.push_back(spec);
}

fuzz::BoxSpec WireBox(int64_t unit, std::vector<int64_t> extent, fuzz::Layout l) {
  fuzz::BoxSpec b;
  b.unit_bytes = unit;
  b.extent = std::move(extent);
  b.layout = l;
  return b;
}

void WireSeeds(const std::string& dir) {
  using fuzz::Layout;
  {
    fuzz::WireScenario s;
    AddBucket(&s, {7, {WireBox(4, {4, 8}, Layout::kRowMajor)}}, 1);
    Write(dir, "one_bucket_row_major", fuzz::EncodeScenario(s));
  }
  {
    fuzz::WireScenario s;
    s.segment_choice = 1;  // 64-byte segments: boxes cut across segments
    AddBucket(&s,
              {(uint64_t{3} << 32) | 1,
               {WireBox(2, {3, 5, 7}, Layout::kPadded),
                WireBox(8, {6, 4}, Layout::kColumnMajor),
                WireBox(1, {16}, Layout::kRowMajor)}},
              9);
    AddBucket(&s, {(uint64_t{3} << 32) | 2, {WireBox(144, {2, 2}, Layout::kPadded)}},
              40);
    Write(dir, "two_buckets_segmented", fuzz::EncodeScenario(s));
  }
  {
    fuzz::WireScenario s;
    s.segment_choice = 3;  // one-byte segments: one unit at a time
    AddBucket(&s, {0, {}}, 0);  // an empty bucket: a header alone
    AddBucket(&s, {1, {WireBox(3, {5}, Layout::kRowMajor),
                       WireBox(4, {0, 9}, Layout::kRowMajor)}}, 3);
    AddBucket(&s, {2, {WireBox(1, {4, 4}, Layout::kBroadcast)}}, 5);
    Write(dir, "empty_odd_and_broadcast", fuzz::EncodeScenario(s));
  }
  {
    fuzz::WireScenario s;
    s.segment_choice = 2;
    AddBucket(&s, {99, {WireBox(8, {16, 16, 4}, Layout::kRowMajor)}}, 2);
    Write(dir, "large_box_4k_segments", fuzz::EncodeScenario(s));
  }
  {
    fuzz::WireScenario s;
    s.wrong_token = true;
    AddBucket(&s, {7, {WireBox(4, {4}, Layout::kRowMajor)}}, 1);
    Write(dir, "wrong_token", fuzz::EncodeScenario(s));
  }
}

// --- checkpoint_fuzzer: selector byte (reader, tp) + a file ---------------

template <typename T>
void Le(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof(T));
}
void GgufString(std::string* out, const std::string& s) {
  Le<uint64_t>(out, s.size());
  out->append(s);
}

void CheckpointSeeds(const std::string& dir) {
  {
    // GGUF v3: an architecture, kv heads, an array; a Q8_0 column-parallel
    // and a Q8_0 row-parallel tensor, 4 x 64 each.
    std::string f = "GGUF";
    Le<uint32_t>(&f, 3);
    Le<uint64_t>(&f, 2);
    Le<uint64_t>(&f, 3);
    GgufString(&f, "general.architecture");
    Le<uint32_t>(&f, 8);
    GgufString(&f, "llama");
    GgufString(&f, "llama.attention.head_count_kv");
    Le<uint32_t>(&f, 4);
    Le<uint32_t>(&f, 2);
    GgufString(&f, "tokenizer.ggml.scores");
    Le<uint32_t>(&f, 9);
    Le<uint32_t>(&f, 6);
    Le<uint64_t>(&f, 2);
    Le<float>(&f, 0.5f);
    Le<float>(&f, -1.0f);
    const char* names[] = {"blk.0.attn_q.weight", "blk.0.attn_output.weight"};
    for (int i = 0; i < 2; ++i) {
      GgufString(&f, names[i]);
      Le<uint32_t>(&f, 2);
      Le<uint64_t>(&f, 64);
      Le<uint64_t>(&f, 4);
      Le<uint32_t>(&f, 8);
      Le<uint64_t>(&f, i * 288);
    }
    while (f.size() % 32 != 0) f.push_back('\0');
    f.append(272, '\x11');
    f.append(16, '\0');
    f.append(272, '\x22');
    Write(dir, "gguf_q8_0_tp2", std::string(1, '\x02') + f);
  }
  {
    const std::string header =
        "{\"__metadata__\":{\"format\":\"pt\"},"
        "\"model.layers.0.self_attn.q_proj.weight\":{\"dtype\":\"BF16\","
        "\"shape\":[4,8],\"data_offsets\":[0,64]},"
        "\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[8],"
        "\"data_offsets\":[64,96]}}";
    std::string f;
    Le<uint64_t>(&f, header.size());
    f.append(header);
    f.append(96, '\x33');
    Write(dir, "safetensors_bf16_tp2", std::string(1, '\x03') + f);
  }
}

}  // namespace
}  // namespace ferry

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string root = argv[1];
  ::mkdir(root.c_str(), 0755);
  ferry::RegistrationSeeds(root + "/registration_fuzzer");
  ferry::LayoutSeeds(root + "/layout_resolution_fuzzer");
  ferry::WireSeeds(root + "/wire_format_fuzzer");
  ferry::CheckpointSeeds(root + "/checkpoint_fuzzer");
  return 0;
}
