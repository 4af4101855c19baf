#include "tests/support/wire_registrations.h"

#include "absl/strings/str_cat.h"

namespace ferry {
namespace testing {

std::string ParamName(int i) {
  return absl::StrCat("model.layers.", i / 16, ".p", i % 16, ".weight");
}

v1::MemoryRegion Region(const SharedMemoryRegion& m) {
  v1::MemoryRegion r;
  r.set_region_id(0);
  r.set_size_bytes(m.size());
  r.mutable_shared_memory()->set_shm_name(m.name());
  return r;
}

// Source rank `rank` of 2: every parameter [2, kCols], the rank's row.
v1::RegisterSourceRequest Source(const std::string& stream, int rank,
                                 int params, const SharedMemoryRegion& m) {
  v1::RegisterSourceRequest req;
  v1::SourceRegistration* s = req.mutable_source();
  s->set_stream(stream);
  s->set_rank(rank);
  s->set_world_size(2);
  s->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  *s->add_regions() = Region(m);
  for (int i = 0; i < params; ++i) {
    v1::ParameterSpec* p = s->add_parameters();
    p->set_name(ParamName(i));
    p->set_dtype(v1::DTYPE_F32);
    p->add_shape(2);
    p->add_shape(kCols);
    v1::Piece* piece = s->add_pieces();
    piece->set_parameter(ParamName(i));
    piece->mutable_box()->add_offset(rank);
    piece->mutable_box()->add_offset(0);
    piece->mutable_box()->add_extent(1);
    piece->mutable_box()->add_extent(kCols);
    piece->set_region_id(0);
    piece->set_byte_offset(int64_t{i} * kCols * 4);
  }
  return req;
}

// An instance of one rank holding every parameter whole.
v1::RegisterDestinationRequest Destination(const std::string& stream,
                                           const std::string& instance,
                                           int params,
                                           const SharedMemoryRegion& m) {
  v1::RegisterDestinationRequest req;
  v1::DestinationRegistration* d = req.mutable_destination();
  d->set_instance_id(instance);
  d->set_stream(stream);
  d->set_tp_rank(0);
  d->set_tp_size(1);
  d->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  *d->add_regions() = Region(m);
  for (int i = 0; i < params; ++i) {
    v1::Piece* piece = d->mutable_explicit_pieces()->add_pieces();
    piece->set_parameter(ParamName(i));
    piece->mutable_box()->add_offset(0);
    piece->mutable_box()->add_offset(0);
    piece->mutable_box()->add_extent(2);
    piece->mutable_box()->add_extent(kCols);
    piece->set_region_id(0);
    piece->set_byte_offset(int64_t{i} * 2 * kCols * 4);
  }
  return req;
}

// One parameter "wide.weight" F32 [2, pieces]: sources hold a row each,
// the destination holds it in one-column pieces (strided).
v1::RegisterSourceRequest WideSource(const std::string& stream, int rank,
                                     int pieces, const SharedMemoryRegion& m) {
  v1::RegisterSourceRequest req;
  v1::SourceRegistration* s = req.mutable_source();
  s->set_stream(stream);
  s->set_rank(rank);
  s->set_world_size(2);
  s->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  *s->add_regions() = Region(m);
  v1::ParameterSpec* p = s->add_parameters();
  p->set_name("wide.weight");
  p->set_dtype(v1::DTYPE_F32);
  p->add_shape(2);
  p->add_shape(pieces);
  v1::Piece* piece = s->add_pieces();
  piece->set_parameter("wide.weight");
  piece->mutable_box()->add_offset(rank);
  piece->mutable_box()->add_offset(0);
  piece->mutable_box()->add_extent(1);
  piece->mutable_box()->add_extent(pieces);
  piece->set_region_id(0);
  return req;
}

v1::RegisterDestinationRequest WideDestination(const std::string& stream,
                                               const std::string& instance,
                                               int pieces,
                                               const SharedMemoryRegion& m) {
  v1::RegisterDestinationRequest req;
  v1::DestinationRegistration* d = req.mutable_destination();
  d->set_instance_id(instance);
  d->set_stream(stream);
  d->set_tp_rank(0);
  d->set_tp_size(1);
  d->mutable_device()->set_kind(v1::DEVICE_KIND_HOST);
  *d->add_regions() = Region(m);
  for (int i = 0; i < pieces; ++i) {
    v1::Piece* piece = d->mutable_explicit_pieces()->add_pieces();
    piece->set_parameter("wide.weight");
    piece->mutable_box()->add_offset(0);
    piece->mutable_box()->add_offset(i);
    piece->mutable_box()->add_extent(2);
    piece->mutable_box()->add_extent(1);
    piece->set_region_id(0);
    piece->set_byte_offset(int64_t{i} * 4);
    piece->add_strides(pieces);
    piece->add_strides(1);
  }
  return req;
}

}  // namespace testing
}  // namespace ferry
