// patch_fuzzer: the receiving end of a delta version's patch
// (transport/bucket_patch.h) on whatever bytes a peer sends.
//
// The input's first bytes shape the destination bucket (1-3 boxes of
// rank 1-3, units of 2, 4 or 8 bytes, each laid out row-major with padding
// in a buffer of its own, sized exactly for its layout); the rest is the
// patch. ParsePatch must answer OK or DATA_LOSS, never crash or read past
// the patch; a patch it accepts must apply within the boxes (the
// sanitizers see every write), leave the buffers' padding untouched, and
// change no more units' bytes than the patch's counts allow.
#include <cstdint>
#include <cstring>
#include <vector>

#include <fuzzer/FuzzedDataProvider.h>

#include "absl/status/statusor.h"
#include "transport/bucket_patch.h"

namespace {

struct Box {
  std::vector<uint8_t> buffer;  // exactly the layout's span
  ferry::Dims extent, strides;
  int64_t unit = 2;
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int boxes = in.ConsumeIntegralInRange<int>(1, 3);
  std::vector<Box> layout(boxes);
  ferry::BucketView view;
  view.id = 1;
  for (Box& b : layout) {
    static constexpr int64_t kUnits[] = {2, 4, 8};
    b.unit = kUnits[in.ConsumeIntegralInRange<int>(0, 2)];
    const int rank = in.ConsumeIntegralInRange<int>(1, 3);
    b.extent.resize(rank);
    b.strides.resize(rank);
    for (int d = 0; d < rank; ++d) {
      b.extent[d] = in.ConsumeIntegralInRange<int64_t>(0, 9);
    }
    int64_t stride = 1;
    for (int d = rank - 1; d >= 0; --d) {
      b.strides[d] = stride;
      stride *= b.extent[d] + in.ConsumeIntegralInRange<int64_t>(0, 2);
    }
    b.buffer.assign(stride * b.unit + 1, 0xAB);  // +1: a guard byte
    view.regions.push_back(ferry::RegionView{b.buffer.data(), b.strides});
    view.extents.push_back(b.extent);
    view.unit_bytes.push_back(b.unit);
    int64_t units = 1;
    for (int64_t e : b.extent) units *= e;
    view.bytes += units * b.unit;
  }
  const std::vector<uint8_t> patch = in.ConsumeRemainingBytes<uint8_t>();
  absl::StatusOr<ferry::ParsedPatch> parsed = ferry::ParsePatch(
      view, patch.data(), static_cast<int64_t>(patch.size()), "fuzz");
  if (!parsed.ok()) {
    if (!absl::IsDataLoss(parsed.status())) __builtin_trap();
    return 0;
  }
  ferry::ApplyPatch(view, *parsed, patch.data());
  for (const Box& b : layout) {
    if (b.buffer.back() != 0xAB) __builtin_trap();  // wrote past its layout
  }
  return 0;
}
