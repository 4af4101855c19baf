// The trainer registration_fuzzer registers before each input, shared with
// make_seeds.cc so that destination seeds name its parameters.
//
// Stream "policy", one rank (world_size 1) holding every parameter of a
// small Llama-style layer whole, back to back in region 0: a fuzzed
// destination of that stream with tp_size 1 completes an instance, so the
// daemon's whole path runs on it (parse, Registry::Add, PlanCache:
// resolution, ValidateDestination, PlanTransfers).
#ifndef FERRY_TESTS_FUZZ_REGISTRATION_INPUT_H_
#define FERRY_TESTS_FUZZ_REGISTRATION_INPUT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "proto/ferry/v1/registration.pb.h"

namespace ferry {
namespace fuzz {

struct TrainerParam {
  const char* name;
  v1::DType dtype;
  std::vector<int64_t> shape;
};

inline const std::vector<TrainerParam>& TrainerParams() {
  static const std::vector<TrainerParam> params = {
      {"model.embed_tokens.weight", v1::DTYPE_BF16, {64, 16}},
      {"model.layers.0.self_attn.q_proj.weight", v1::DTYPE_BF16, {16, 16}},
      {"model.layers.0.self_attn.k_proj.weight", v1::DTYPE_BF16, {8, 16}},
      {"model.layers.0.self_attn.v_proj.weight", v1::DTYPE_BF16, {8, 16}},
      {"model.layers.0.self_attn.o_proj.weight", v1::DTYPE_BF16, {16, 16}},
      {"model.layers.0.self_attn.rotary_emb.inv_freq", v1::DTYPE_F32, {8}},
      {"model.layers.0.mlp.gate_proj.weight", v1::DTYPE_BF16, {32, 16}},
      {"model.layers.0.mlp.up_proj.weight", v1::DTYPE_BF16, {32, 16}},
      {"model.layers.0.mlp.down_proj.weight", v1::DTYPE_BF16, {16, 32}},
      {"model.layers.0.mlp.experts.0.w1.weight", v1::DTYPE_BF16, {8, 16}},
      {"model.layers.0.mlp.experts.0.w3.weight", v1::DTYPE_BF16, {8, 16}},
      {"model.layers.0.mlp.experts.1.w1.weight", v1::DTYPE_BF16, {8, 16}},
      {"model.layers.0.mlp.experts.1.w3.weight", v1::DTYPE_BF16, {8, 16}},
      {"model.norm.weight", v1::DTYPE_F32, {16}},
      {"lm_head.weight", v1::DTYPE_Q8_0, {64, 32}},
  };
  return params;
}

inline int64_t TrainerParamBytes(const TrainerParam& p) {
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  switch (p.dtype) {
    case v1::DTYPE_F32:
      return n * 4;
    case v1::DTYPE_Q8_0:
      return n / 32 * 34;
    default:
      return n * 2;
  }
}

inline v1::SourceRegistration Trainer() {
  v1::SourceRegistration s;
  s.set_stream("policy");
  s.set_rank(0);
  s.set_world_size(1);
  s.mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  int64_t at = 0;
  for (const TrainerParam& p : TrainerParams()) {
    v1::ParameterSpec* spec = s.add_parameters();
    spec->set_name(p.name);
    spec->set_dtype(p.dtype);
    v1::Piece* piece = s.add_pieces();
    piece->set_parameter(p.name);
    for (int64_t d : p.shape) {
      spec->add_shape(d);
      piece->mutable_box()->add_offset(0);
      piece->mutable_box()->add_extent(d);
    }
    piece->set_region_id(0);
    piece->set_byte_offset(at);
    at += TrainerParamBytes(p);
  }
  v1::MemoryRegion* r = s.add_regions();
  r->set_region_id(0);
  r->set_size_bytes(at);
  r->mutable_shared_memory()->set_shm_name("/ferry.policy.0.0");
  return s;
}

}  // namespace fuzz
}  // namespace ferry

#endif  // FERRY_TESTS_FUZZ_REGISTRATION_INPUT_H_
