#include "daemon/registry/adapter_binding.h"

#include "proto/convert.h"

namespace ferry {

void AdapterApply(const AdapterBinding& adapter, v1::ApplyDetail* apply) {
  for (const AdapterBinding::Share& s : adapter.shares) {
    v1::FallbackTensor* t = apply->add_fallback_tensors();
    t->set_parameter(s.parameter);
    t->set_dtype(DTypeToProto(s.dtype));
    for (int64_t d : s.shape) t->add_shape(d);
    t->set_region_id(adapter.exported.region_id());
    t->set_byte_offset(s.byte_offset);
    t->set_size_bytes(s.bytes);
    if (!s.whole) *t->mutable_share() = BoxToProto(s.box);
  }
  *apply->add_staging_regions() = adapter.exported;
  apply->set_adapter_config_json(adapter.config_json);
}

}  // namespace ferry
