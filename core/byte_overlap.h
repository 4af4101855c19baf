// Byte overlap: whether strided boxes laid out in memory share a byte.
//
// A destination rank must not write one byte twice (two pieces, or two
// elements of one piece): the bytes would land from possibly different
// sources in an order nobody chose. Pieces are strided boxes, so two pieces
// may interleave (one-column pieces of one tensor) without sharing a byte;
// the check is exact for those and near-linear for the common layouts:
//
//   1. each layout alone: its strides, sorted, must each step past the span
//      of the dimensions inside it (PyTorch's "non-overlapping" test). A
//      zero stride along a dimension of extent > 1 fails it. This is a
//      sufficient test: exotic strides that are disjoint without being
//      nested are refused, fail-closed.
//   2. layouts are sorted by their byte span [first byte, last byte + 1);
//      spans that overlap no other span need nothing more (the common case:
//      contiguous tensors and row shards, O(n log n) in all).
//   3. a cluster of overlapping spans is cut into contiguous runs (a
//      one-column piece of a 2-row tensor is 2 runs), runs are sorted, and a
//      run starting before the previous runs ended is an overlap, exactly.
//      Runs are counted against a budget (Limits::kMaxOverlapProofRuns); a
//      cluster that would exceed it is reported, not checked for minutes.
//
// Pure; any thread.
#ifndef FERRY_CORE_BYTE_OVERLAP_H_
#define FERRY_CORE_BYTE_OVERLAP_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "core/geometry.h"

namespace ferry {

// One strided box in memory: `extent[d]` units along dimension d, `stride[d]`
// units apart, the first unit at byte `offset` of the memory named `key`
// (a buffer, or a parameter's canonical layout). Units are `unit_bytes`
// bytes (an element, or a quantization block).
struct StridedLayout {
  uint64_t key = 0;
  int64_t offset = 0;
  Dims extent;
  Dims stride;
  int64_t unit_bytes = 1;
};

// "" when no two units of `layout` can share a byte (test 1 above), else
// why, e.g. "stride 0 along dim 1 (extent 4) puts several elements on one
// byte". REQUIRES: extent.size() == stride.size(), strides >= 0.
std::string SelfOverlapProblem(const StridedLayout& layout);

struct OverlapResult {
  // Indices into the input of two layouts sharing a byte; -1: none.
  int32_t first = -1;
  int32_t second = -1;
  int64_t at_byte = 0;  // a byte both write (with first/second)
  // True when a cluster needed more than `max_runs` runs: first and second
  // are then two layouts of that cluster, not proven to overlap.
  bool budget_exhausted = false;
  bool found() const { return first >= 0; }
};

// A layout's bytes from its first to one past its last, under its key:
// all test 2 needs. Test 3 asks for the layout itself, and only for the
// few whose spans overlap another's.
struct LayoutSpan {
  uint64_t key = 0;
  int64_t begin = 0;
  int64_t end = 0;
  int32_t layout = 0;  // the caller's index of the layout
};

// The span of `layout`, or nullopt when it writes nothing (a zero extent).
// REQUIRES: its end fits in int64 (validated by the caller).
std::optional<LayoutSpan> SpanOf(const StridedLayout& layout, int32_t index);

// Two layouts with the same key that share a byte (tests 2 and 3).
// Layouts with a zero extent write nothing and never overlap. REQUIRES:
// each layout passed SelfOverlapProblem and its span fits in int64.
OverlapResult FindOverlap(const std::vector<StridedLayout>& layouts,
                          int64_t max_runs);

// The same over spans (reordered in place), building a layout with
// `layout_of(span.layout)` only when its span overlaps another: a rank's
// ~140,000 pieces then need no StridedLayout each, only a 32-byte span.
// The indices in the result are the spans' `layout` values. The runs it
// cuts are taken from `*runs_left`, so that several calls (a rank's
// parameters, then its buffers) can share one budget.
OverlapResult FindOverlap(
    std::vector<LayoutSpan>& spans,
    absl::FunctionRef<StridedLayout(int32_t)> layout_of, int64_t* runs_left);

}  // namespace ferry

#endif  // FERRY_CORE_BYTE_OVERLAP_H_
